"""Per-op cost of a captured ATen graph: matrix FLOPs, vector FLOPs, bytes read and written.

Conventions (each tensor at its own dtype):
- bytes count the *unique* elements a tensor addresses: a stride-0 (broadcast / expanded)
  dimension counts once, so `x[R,C] + b[C]` moves (2RC + C) elements.
- views (`view`, `transpose`, `slice`, `expand`, a `reshape` or `contiguous` that needs no
  copy, ...) cost nothing; reads through a view are charged to the tensor it aliases.
- matmul-like ops cost 2*out*K matrix FLOPs (K the contraction length); convolution 2*out*(Cin/g * k).
- attention (`scaled_dot_product_attention` and its CPU/flash/efficient/cudnn variants) costs
  2*pairs*(D + Dv) matrix FLOPs per batch-head, pairs = Sq*Sk, or the causal (top-left,
  as torch defines `is_causal`) count; GQA's smaller K/V are read at their own size.
- an embedding or gather reads only the gathered rows; a KV-cache update (`copy_` into a slice,
  `index_copy`, `index_put`, `slice_scatter`) reads and writes the written slice, not the buffer.
- pointwise ops: 1 vector FLOP per output element; reductions 1 per input element;
  softmax 5 and norms 6 per element.
- anything else is "unknown": bytes = inputs + outputs, no FLOPs, and listed in the coverage.
"""

from __future__ import annotations

import math
import operator
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch import fx

from spirit.sol.capture import Captured


@dataclass
class OpCost:
    node: str
    op: str
    kind: str  # matmul, attention, softmax, norm, embedding, kv-update, reduction, pointwise, movement, creation, view, free, unknown
    dtype: torch.dtype | None = None
    matrix_flops: float = 0.0
    vector_flops: float = 0.0
    reads: dict[str, float] = field(default_factory=dict)  # bytes read, by alias root
    writes: dict[str, float] = field(default_factory=dict)  # bytes written, by alias root

    @property
    def bytes_read(self) -> float:
        return sum(self.reads.values())

    @property
    def bytes_written(self) -> float:
        return sum(self.writes.values())

    @property
    def bytes(self) -> float:
        return self.bytes_read + self.bytes_written


@dataclass
class GraphCost:
    ops: list[OpCost]
    root_bytes: dict[str, float]  # full size of every alias root
    inputs: set[str]  # roots that are graph inputs
    weights: set[str]  # roots that are parameters / buffers / constants
    outputs: set[str]  # roots the graph returns
    unknown: Counter  # op name -> count, for the coverage report
    method: str = ""

    @property
    def matrix_flops(self) -> float:
        return sum(o.matrix_flops for o in self.ops)

    @property
    def vector_flops(self) -> float:
        return sum(o.vector_flops for o in self.ops)

    @property
    def bytes(self) -> float:
        return sum(o.bytes for o in self.ops)

    def coverage(self) -> float:
        """Fraction of ops (views and free nodes excluded) that have a cost rule."""
        counted = [o for o in self.ops if o.kind not in ("view", "free")]
        return 1.0 if not counted else 1 - sum(self.unknown.values()) / len(counted)

    def io_bytes(self) -> float:
        """Bytes a perfectly fused kernel must move: each input or weight read once (only what
        the graph reads of it: the gathered rows, the visible KV slice), each output and each
        mutated input slice written once."""
        reads: dict[str, float] = {}
        writes: dict[str, float] = {}
        for o in self.ops:
            for r, b in o.reads.items():
                if r in self.inputs or r in self.weights:
                    reads[r] = max(reads.get(r, 0.0), b)
            for r, b in o.writes.items():
                if r in self.outputs or r in self.inputs or r in self.weights:
                    writes[r] = max(writes.get(r, 0.0), b)
        return sum(min(b, self.root_bytes[r]) for r, b in reads.items()) + sum(writes.values())

    def by_kind(self) -> dict[str, tuple[int, float, float]]:
        """kind -> (count, FLOPs, bytes)."""
        out: dict[str, list] = {}
        for o in self.ops:
            row = out.setdefault(o.kind, [0, 0.0, 0.0])
            row[0] += 1
            row[1] += o.matrix_flops + o.vector_flops
            row[2] += o.bytes
        return {k: tuple(v) for k, v in out.items()}


def unique_elements(t: torch.Tensor) -> int:
    """Elements a tensor addresses: stride-0 dimensions count once."""
    if t.numel() == 0:
        return 0
    return math.prod(s for s, st in zip(t.shape, t.stride()) if st != 0)


def tensor_bytes(t: torch.Tensor) -> float:
    return float(unique_elements(t) * t.element_size())


def _is_tensor(v) -> bool:
    return isinstance(v, torch.Tensor)


def _name(target) -> str:
    return getattr(target, "_opname", None) or getattr(target, "__name__", None) or str(target)


MATMUL = {"mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "mv", "addmv", "dot", "vdot", "_addmm_activation", "addbmm"}
# the operand whose last dimension is the contraction length K
_LEFT_OPERAND = {"mm": "self", "addmm": "mat1", "bmm": "self", "baddbmm": "batch1", "addbmm": "batch1",
                 "matmul": "self", "linear": "input", "mv": "self", "addmv": "mat", "dot": "self", "vdot": "self",
                 "_addmm_activation": "mat1"}
CONV = {"convolution", "_convolution", "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d"}
ATTENTION = {"scaled_dot_product_attention", "_scaled_dot_product_flash_attention_for_cpu",
             "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_attention_math",
             "_scaled_dot_product_fused_attention_overrideable"}
SOFTMAX = {"softmax", "_softmax", "log_softmax", "_log_softmax", "_safe_softmax"}
NORM = {"rms_norm", "_fused_rms_norm", "layer_norm", "native_layer_norm", "group_norm", "native_group_norm",
        "batch_norm", "_native_batch_norm_legit_no_training", "_native_batch_norm_legit", "native_batch_norm",
        "instance_norm", "_batch_norm_impl_index"}
GATHER = {"embedding", "index_select", "index", "_unsafe_index", "gather", "take", "embedding_bag", "_embedding_bag"}
KV_UPDATE = {"copy_", "index_copy_", "index_copy", "index_put_", "index_put", "_index_put_impl_", "_index_put_impl",
             "slice_scatter", "select_scatter", "scatter_", "scatter", "masked_scatter_", "masked_scatter"}
REDUCTION = {"sum", "mean", "amax", "amin", "max", "min", "var", "std", "var_mean", "std_mean", "norm",
             "linalg_vector_norm", "prod", "argmax", "argmin", "logsumexp", "cumsum", "cumprod", "any", "all",
             "count_nonzero", "aminmax", "topk", "sort", "argsort", "nansum"}
MAYBE_VIEW = {"reshape", "flatten", "unflatten", "view_as", "reshape_as", "contiguous", "to", "type_as",
              "dropout", "lift_fresh_copy", "_unsafe_view", "alias", "detach", "expand_as"}
FREE_CREATION = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "empty_permuted"}
CREATION = {"zeros", "ones", "full", "arange", "zeros_like", "ones_like", "full_like", "new_zeros", "new_ones",
            "new_full", "scalar_tensor", "fill", "fill_", "zero_", "rand", "randn", "rand_like", "randn_like",
            "linspace", "eye", "tensor", "randint", "randperm", "tril_indices", "triu_indices"}
MOVEMENT = {"clone", "_to_copy", "copy", "cat", "stack", "repeat", "flip", "roll", "constant_pad_nd", "pad",
            "tril", "triu", "expand_copy", "permute_copy", "_unsafe_view_copy", "repeat_interleave",
            "hstack", "vstack", "tile", "narrow_copy", "masked_select", "nonzero"}
# Python-level nodes of pre-dispatch graphs (autocast / grad-mode markers) and shape queries
FREE_PY = {"_enter_autocast", "_exit_autocast", "_set_grad_enabled", "sym_size", "sym_stride", "sym_numel",
           "sym_storage_offset", "_assert_tensor_metadata", "_assert_scalar", "_local_scalar_dense",
           "sym_constrain_range_for_size", "_assert_async", "scalar_tensor_", "getattr"}


def _is_python_operator(target, name: str) -> bool:
    """`operator.and_`, `Tensor.__iand__` and the like, which some graphs keep: pointwise."""
    return getattr(target, "__module__", None) == "_operator" or (name.startswith("__") and name.endswith("__"))


def _bind(node: fx.Node) -> dict:
    """Argument name -> value (fx Node or constant) by the op's schema."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return {}
    bound = {a.name: a.default_value if a.has_default_value() else None for a in schema.arguments}
    for a, v in zip(schema.arguments, node.args):
        bound[a.name] = v
    bound.update(node.kwargs)
    return bound


def _is_schema_view(target) -> bool:
    schema = getattr(target, "_schema", None)
    if schema is None or not schema.returns:
        return False
    info = schema.returns[0].alias_info
    return info is not None and not info.is_write and not any(
        a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)


def _mutated_arg(node: fx.Node) -> fx.Node | None:
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return None
    for a, v in zip(schema.arguments, node.args):
        if a.alias_info is not None and a.alias_info.is_write and isinstance(v, fx.Node):
            return v
    return None


def _reshape_is_view(inp: torch.Tensor, out: torch.Tensor) -> bool:
    try:
        torch.empty_strided(inp.shape, inp.stride(), dtype=inp.dtype, device="meta").view(out.shape)
        return True
    except RuntimeError:
        return False


def _maybe_view_is_view(name: str, node: fx.Node, inp, out) -> bool:
    if not (_is_tensor(inp) and _is_tensor(out)):
        return True
    if name in ("lift_fresh_copy", "_unsafe_view", "alias", "detach", "dropout", "expand_as"):
        return True
    if out.dtype != inp.dtype or out.device != inp.device:
        return False
    if name == "contiguous":
        fmt = node.kwargs.get("memory_format", torch.contiguous_format)
        return inp.is_contiguous(memory_format=fmt)
    if name in ("to", "type_as"):
        return tuple(out.stride()) == tuple(inp.stride()) and not node.kwargs.get("copy", False)
    return _reshape_is_view(inp, out)


class _Walker:
    def __init__(self, captured: Captured) -> None:
        self.graph = captured.graph
        self.weights_names = captured.weights
        self.root: dict[str, str] = {}
        self.root_bytes: dict[str, float] = {}
        self.ops: list[OpCost] = []
        self.unknown: Counter = Counter()
        self.inputs: set[str] = set()
        self.weights: set[str] = set()
        self.outputs: set[str] = set()

    def val(self, n):
        return n.meta.get("val") if isinstance(n, fx.Node) else None

    def tensor_args(self, node: fx.Node) -> list[fx.Node]:
        found = []
        for a in node.all_input_nodes:
            if _is_tensor(self.val(a)) and a not in found:
                found.append(a)
        return found

    def new_root(self, n: fx.Node, val) -> None:
        self.root[n.name] = n.name
        if _is_tensor(val):
            self.root_bytes[n.name] = tensor_bytes(val)

    def read(self, cost: OpCost, n: fx.Node, nbytes: float | None = None) -> None:
        r = self.root.get(n.name, n.name)
        b = tensor_bytes(self.val(n)) if nbytes is None else nbytes
        cost.reads[r] = min(cost.reads.get(r, 0.0) + b, self.root_bytes.get(r, math.inf))

    def write_outputs(self, cost: OpCost, node: fx.Node) -> None:
        val = self.val(node)
        if _is_tensor(val):
            self.new_root(node, val)
            cost.writes[node.name] = tensor_bytes(val)
            return
        if isinstance(val, (tuple, list)):
            # multi-output op: count the outputs something uses (logsumexp, rstd are often unused)
            for user in node.users:
                if user.target is operator.getitem:
                    i = user.args[1]
                    out = val[i] if isinstance(i, int) and i < len(val) else None
                    if _is_tensor(out) and (user.users or user in self._returned):
                        self.new_root(user, out)
                        cost.writes[user.name] = tensor_bytes(out)
            self.root[node.name] = node.name

    def run(self) -> GraphCost:
        self._returned = set()
        for node in self.graph.nodes:
            if node.op == "output":
                for a in torch.utils._pytree.tree_leaves(node.args):
                    if isinstance(a, fx.Node):
                        self._returned.add(a)
        for node in self.graph.nodes:
            val = self.val(node)
            if node.op == "placeholder":
                self.new_root(node, val)
                (self.weights if node.name in self.weights_names else self.inputs).add(node.name)
            elif node.op == "get_attr":
                if val is None:
                    owner = self.graph.owning_module
                    val = getattr(owner, str(node.target), None) if owner is not None else None
                    node.meta["val"] = val
                self.new_root(node, val)
                self.weights.add(node.name)
            elif node.op == "call_function":
                self.call(node, val)
            elif node.op == "output":
                for a in self._returned:
                    if a.name in self.root:
                        self.outputs.add(self.root[a.name])
            elif node.op in ("call_module", "call_method"):
                self.unknown_op(node, val, str(node.target))
        outputs = self.outputs - self.inputs - self.weights
        return GraphCost(self.ops, self.root_bytes, self.inputs, self.weights, outputs, self.unknown)

    def unknown_op(self, node: fx.Node, val, name: str) -> None:
        cost = OpCost(node.name, name, "unknown", getattr(val, "dtype", None))
        for a in self.tensor_args(node):
            self.read(cost, a)
        self.write_outputs(cost, node)
        self.unknown[name] += 1
        self.ops.append(cost)

    def call(self, node: fx.Node, val) -> None:  # noqa: C901 - one dispatch table, read top to bottom
        target = node.target
        name = _name(target)
        args = self.tensor_args(node)
        first = self.val(args[0]) if args else None
        if target is operator.getitem:
            parent = node.args[0]
            if parent.name in self.root and self.root[parent.name] != parent.name:  # a view / alias op's piece
                self.root[node.name] = self.root[parent.name]
            elif node.name not in self.root:
                self.new_root(node, val)
            return
        if name in FREE_PY or not (_is_tensor(val) or isinstance(val, (tuple, list))):
            self.ops.append(OpCost(node.name, name, "free"))
            if args:
                self.root[node.name] = self.root.get(args[0].name, args[0].name)
            return
        if name in FREE_CREATION:
            self.new_root(node, val)
            self.ops.append(OpCost(node.name, name, "creation", getattr(val, "dtype", None)))
            return
        if name in MAYBE_VIEW:
            if _maybe_view_is_view(name, node, first, val):
                self.view(node, name, args)
                return
            cost = OpCost(node.name, name, "movement", getattr(val, "dtype", None))
            self.read(cost, args[0])
            self.write_outputs(cost, node)
            self.ops.append(cost)
            return
        if name in KV_UPDATE:
            self.kv_update(node, name, val)
            return
        if _is_schema_view(target):
            self.view(node, name, args)
            return
        mutated = _mutated_arg(node)
        if name in MATMUL or name in CONV:
            cost = self.matmul(node, name, val)
        elif name in ATTENTION:
            cost = self.attention(node, name, val)
        elif name in GATHER:
            cost = self.gather(node, name, val)
        else:
            dtype = getattr(val, "dtype", None) if _is_tensor(val) else getattr(first, "dtype", None)
            if name in SOFTMAX:
                kind, vec = "softmax", 5 * first.numel()
            elif name in NORM:
                kind, vec = "norm", 6 * first.numel()
            elif name in REDUCTION:
                kind, vec = "reduction", first.numel() if first is not None else 0
            elif torch.Tag.pointwise in getattr(target, "tags", ()) or _is_python_operator(target, name):
                kind, vec = "pointwise", (val.numel() if _is_tensor(val) else 0)
            elif name in CREATION:
                kind, vec = "creation", 0
            elif name in MOVEMENT:
                kind, vec = "movement", 0
            else:
                self.unknown_op(node, val, name)
                return
            cost = OpCost(node.name, name, kind, dtype, vector_flops=float(vec))
            for a in args:
                self.read(cost, a)
        if mutated is not None:
            r = self.root.get(mutated.name, mutated.name)
            cost.writes[r] = tensor_bytes(self.val(mutated))
            self.root[node.name] = r
        else:
            self.write_outputs(cost, node)
        self.ops.append(cost)

    def view(self, node: fx.Node, name: str, args: list[fx.Node]) -> None:
        src = args[0] if args else None
        self.root[node.name] = self.root.get(src.name, src.name) if src is not None else node.name
        self.ops.append(OpCost(node.name, name, "view"))

    def matmul(self, node: fx.Node, name: str, val) -> OpCost:
        b = _bind(node)
        if name in CONV:
            x, w = self.val(b.get("input")), self.val(b.get("weight"))
            transposed = bool(b.get("transposed")) or name.startswith("conv_transpose")
            per_out = w.numel() / w.shape[0]
            mat = 2.0 * (x.numel() if transposed else val.numel()) * per_out
            has_bias = b.get("bias") is not None
        else:
            a = self.val(b[_LEFT_OPERAND[name]])
            k = a.shape[-1] if a.dim() else 1
            out_elems = val.numel()
            if name == "addbmm":
                out_elems = self.val(b["batch1"]).shape[0] * val.numel()
            mat = 2.0 * out_elems * k
            has_bias = name in ("addmm", "baddbmm", "addbmm", "addmv", "_addmm_activation") or (
                name == "linear" and b.get("bias") is not None)
        # the dtype of the activations decides the peak (weights may be stored narrower)
        dtype = self.val(b.get("input")).dtype if name == "linear" or name in CONV else a.dtype
        cost = OpCost(node.name, name, "matmul", dtype, matrix_flops=mat,
                      vector_flops=float(val.numel()) if has_bias else 0.0)
        for arg in self.tensor_args(node):
            self.read(cost, arg)
        return cost

    def attention(self, node: fx.Node, name: str, val) -> OpCost:
        b = _bind(node)
        q, k, v = (self.val(b[n]) for n in ("query", "key", "value"))
        mask = b.get("attn_mask", b.get("attn_bias"))
        causal = bool(b.get("is_causal")) and mask is None
        sq, sk = q.shape[-2], k.shape[-2]
        pairs = sum(min(i + 1, sk) for i in range(sq)) if causal else sq * sk
        bh = math.prod(q.shape[:-2])
        cost = OpCost(node.name, name, "attention", q.dtype,
                      matrix_flops=2.0 * bh * pairs * (q.shape[-1] + v.shape[-1]),
                      vector_flops=5.0 * bh * pairs)
        for a in self.tensor_args(node):
            self.read(cost, a)
        return cost

    def gather(self, node: fx.Node, name: str, val) -> OpCost:
        cost = OpCost(node.name, name, "embedding" if name.startswith("embedding") else "gather",
                      getattr(val, "dtype", None))
        args = self.tensor_args(node)
        source = args[0]
        src_val = self.val(source)
        out = val[0] if isinstance(val, (tuple, list)) else val
        # the gathered rows: as many source elements as the output has, at the source's dtype
        self.read(cost, source, float(out.numel() * src_val.element_size()))
        for a in args[1:]:
            self.read(cost, a)
        return cost

    def kv_update(self, node: fx.Node, name: str, val) -> None:
        b = _bind(node)
        dst = node.args[0]
        src = b.get("src", b.get("source", b.get("values", b.get("value"))))
        if name.startswith("masked_scatter"):
            src = b.get("source")
        cost = OpCost(node.name, name, "kv-update", self.val(dst).dtype)
        dst_root = self.root.get(dst.name, dst.name)
        if isinstance(src, fx.Node) and _is_tensor(self.val(src)):
            s = self.val(src)
            self.read(cost, src)
            written = float(s.numel() * self.val(dst).element_size())
            if name == "copy_":
                written = tensor_bytes(self.val(dst))
        else:  # a scalar fill of the slice
            written = tensor_bytes(self.val(dst)) if name == "copy_" else 0.0
        for a in self.tensor_args(node):
            if a is not dst and a is not src:
                self.read(cost, a)  # indices, masks
        cost.writes[dst_root] = cost.writes.get(dst_root, 0.0) + written
        self.root[node.name] = dst_root  # the functional forms return the updated buffer
        self.ops.append(cost)


def graph_cost(captured: Captured) -> GraphCost:
    cost = _Walker(captured).run()
    cost.method = captured.method
    return cost
