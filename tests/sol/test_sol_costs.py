"""Closed-form cases of the per-op cost model."""

import torch
import torch.nn.functional as F

B4 = 4  # bytes per fp32 element


def counted(cost):
    """The ops that cost something (views and free nodes left out)."""
    return [o for o in cost.ops if o.kind not in ("view", "free")]


def test_gemm_flops_and_bytes(cost_of):
    m, k, n = 8, 32, 16
    cost = cost_of(lambda a, b: a @ b, torch.randn(m, k), torch.randn(k, n))
    (op,) = counted(cost)
    assert op.kind == "matmul"
    assert op.matrix_flops == 2 * m * n * k
    assert op.bytes == (m * k + k * n + m * n) * B4
    assert cost.io_bytes() == op.bytes


def test_gemv(cost_of):
    n, k = 64, 48
    cost = cost_of(lambda w, x: w @ x, torch.randn(n, k), torch.randn(k))
    (op,) = counted(cost)
    assert op.matrix_flops == 2 * n * k
    assert op.bytes == (n * k + k + n) * B4


def test_linear_with_bf16_weights_counts_each_dtype(cost_of):
    lin = torch.nn.Linear(32, 16, bias=True).to(torch.bfloat16)
    cost = cost_of(lin, torch.randn(4, 32, dtype=torch.bfloat16))
    (op,) = counted(cost)
    assert op.matrix_flops == 2 * 4 * 16 * 32 and op.vector_flops == 4 * 16
    assert op.bytes == (4 * 32 + 32 * 16 + 16 + 4 * 16) * 2
    assert cost.weights and len(cost.weights) == 2


def test_elementwise_add(cost_of):
    n = 1000
    (op,) = counted(cost_of(lambda a, b: a + b, torch.randn(n), torch.randn(n)))
    assert op.bytes == 3 * n * B4 and op.vector_flops == n


def test_bias_broadcast_counts_unique_elements(cost_of):
    r, c = 16, 24
    (op,) = counted(cost_of(lambda x, b: x + b, torch.randn(r, c), torch.randn(c)))
    assert op.bytes == (2 * r * c + c) * B4
    expanded = counted(cost_of(lambda x, b: x + b.expand(r, c), torch.randn(r, c), torch.randn(c)))
    assert sum(o.bytes for o in expanded) == (2 * r * c + c) * B4


def test_softmax_is_one_op(cost_of):
    r, c = 8, 50
    (op,) = counted(cost_of(lambda x: torch.softmax(x, -1), torch.randn(r, c)))
    assert op.kind == "softmax" and op.bytes == 2 * r * c * B4


def test_rms_norm_is_one_op(cost_of):
    r, c = 8, 64
    (op,) = counted(cost_of(lambda x, w: F.rms_norm(x, (c,), w), torch.randn(r, c), torch.randn(c)))
    assert op.kind == "norm" and op.bytes == (2 * r * c + c) * B4


def test_attention_flops_full_and_causal(cost_of):
    b, h, s, d = 2, 4, 16, 8
    q, k, v = (torch.randn(b, h, s, d) for _ in range(3))
    (full,) = counted(cost_of(lambda q, k, v: F.scaled_dot_product_attention(q, k, v), q, k, v))
    assert full.kind == "attention" and full.matrix_flops == 4 * b * h * s * s * d
    (causal,) = counted(cost_of(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), q, k, v))
    assert causal.matrix_flops == 4 * b * h * d * s * (s + 1) / 2
    assert 0.5 <= causal.matrix_flops / full.matrix_flops <= 0.55


def test_decode_attention_bytes_with_gqa(cost_of):
    h, hkv, s, d = 8, 2, 100, 16
    q = torch.randn(1, h, 1, d)
    k, v = torch.randn(1, hkv, s, d), torch.randn(1, hkv, s, d)
    (op,) = counted(cost_of(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, enable_gqa=True), q, k, v))
    assert op.bytes == (2 * h * d + 2 * hkv * s * d) * B4
    assert op.matrix_flops == 4 * h * s * d
    # multi-query K/V broadcast to every head by a stride-0 expand are still read once
    k1, v1 = torch.randn(1, 1, s, d), torch.randn(1, 1, s, d)
    (mqa,) = counted(cost_of(lambda q, k, v: F.scaled_dot_product_attention(q, k.expand(1, h, s, d), v.expand(1, h, s, d)), q, k1, v1))
    assert mqa.bytes == (2 * h * d + 2 * s * d) * B4


def test_cpu_sdpa_variant_is_attention():
    from spirit.sol import graph_cost
    from spirit.sol.capture import capture

    q = torch.randn(1, 2, 4, 8)

    def fn(q, k, v):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, is_causal=True)[0]

    cost = graph_cost(capture(fn, (q, q.clone(), q.clone()), use_export=False))
    (op,) = counted(cost)
    assert op.kind == "attention" and op.matrix_flops == 4 * 2 * 8 * (4 * 5 / 2)
    assert op.bytes_written == q.numel() * B4  # the unused logsumexp output is not charged


def test_views_cost_nothing_and_contiguous_copies(cost_of):
    n = 12 * 10
    x = torch.randn(12, 10)
    view_only = cost_of(lambda x: x.t().unsqueeze(0)[:, 2:5].transpose(1, 2), x)
    assert view_only.bytes == 0 and not counted(view_only) and view_only.io_bytes() == 0
    copy = cost_of(lambda x: x.t().contiguous(), x)
    assert copy.bytes == 2 * n * B4
    already = cost_of(lambda x: x.contiguous().view(-1), x)
    assert already.bytes == 0


def test_kv_update_counts_the_written_slice(cost_of):
    buf = torch.zeros(1, 2, 64, 8)
    new = torch.ones(1, 2, 1, 8)

    def update(buf, new):
        buf[:, :, 10:11] = new
        return buf[:, :, :11]

    cost = cost_of(update, buf, new)
    (op,) = counted(cost)
    assert op.kind == "kv-update" and op.bytes == 2 * new.numel() * B4
    idx = torch.tensor([10])
    (op,) = counted(cost_of(lambda buf, new, i: buf.index_copy_(2, i, new), buf, new, idx))
    assert op.bytes - 8 == 2 * new.numel() * B4  # plus the int64 index


def test_embedding_reads_only_gathered_rows(cost_of):
    vocab, d = 1000, 16
    ids = torch.tensor([[3, 7]])
    (op,) = counted(cost_of(lambda w, i: F.embedding(i, w), torch.randn(vocab, d), ids))
    assert op.bytes == (2 * d + 2 * d) * B4 + ids.numel() * 8


def test_unknown_op_is_reported(cost_of):
    cost = cost_of(lambda x: torch.fft.rfft(x), torch.randn(64))
    assert cost.unknown and cost.coverage() < 1
    (op,) = counted(cost)
    assert op.kind == "unknown" and op.matrix_flops == op.vector_flops == 0
    assert op.bytes == 64 * B4 + 33 * 8


def test_conv2d_flops(cost_of):
    conv = torch.nn.Conv2d(3, 8, kernel_size=3, padding=1, bias=False)
    (op,) = counted(cost_of(conv, torch.randn(2, 3, 16, 16)))
    assert op.kind == "matmul" and op.matrix_flops == 2 * (2 * 8 * 16 * 16) * (3 * 3 * 3)
