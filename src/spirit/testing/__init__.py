"""Tiny random-initialized models and an offline byte-level tokenizer, for tests and demos.

Nothing here downloads anything: the tokenizer is built from the 256 byte symbols, and the
models are random-initialized from small configs of each supported architecture.
"""

from __future__ import annotations

import torch

ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral", "gemma3")
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def byte_tokenizer():
    """A byte-level tokenizer: 256 byte tokens, no merges, three special tokens (ids 256..258)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {ch: i for i, ch in enumerate(bytes_to_unicode().values())}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(list(SPECIAL_TOKENS))  # ids 256, 257, 258 in this order
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.chat_template = CHAT_TEMPLATE
    return tok


def tiny_config(arch: str, num_layers: int = 4, vocab_size: int = 264, hidden: int = 64):
    """A small config of one architecture (vocab covers the byte tokenizer)."""
    from transformers import Gemma3TextConfig, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common = dict(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        # the byte tokenizer's <|im_end|> and <|endoftext|>; none when the vocabulary is smaller
        eos_token_id=258 if vocab_size > 258 else None, pad_token_id=256 if vocab_size > 256 else None,
        bos_token_id=None, tie_word_embeddings=False,
    )
    if arch == "llama":
        return LlamaConfig(**common)
    if arch == "qwen2":
        return Qwen2Config(**common)
    if arch == "qwen3":
        return Qwen3Config(**common, head_dim=hidden // 4)
    if arch == "mistral":
        return MistralConfig(**common, sliding_window=16)
    if arch == "gemma3":
        types = ["sliding_attention" if (i + 1) % 3 else "full_attention" for i in range(num_layers)]
        return Gemma3TextConfig(**common, head_dim=hidden // 4, sliding_window=16, layer_types=types,
                                final_logit_softcapping=30.0)
    raise ValueError(f"unknown architecture {arch!r}; choose from {ARCHITECTURES}")


def tiny_model(
    arch: str = "llama", num_layers: int = 4, seed: int = 0, dtype: torch.dtype = torch.float32,
    logit_scale: float = 8.0, **kw,
):
    """A random-initialized *ForCausalLM of the given architecture, in eval mode."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = tiny_config(arch, num_layers, **kw)
    config._attn_implementation = "sdpa"
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    # random init gives near-uniform logits; a larger embedding scale makes greedy choices
    # clear-cut, so exactness tests are not decided by float ties
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(logit_scale)
    return model.eval()


def tiny_spirit(arch: str = "llama", num_layers: int = 4, seed: int = 0, **kw):
    """A ready `Spirit` over a tiny random model and the byte tokenizer."""
    from spirit.api import from_pretrained_model

    return from_pretrained_model(tiny_model(arch, num_layers, seed, **kw), byte_tokenizer(), name=f"tiny-{arch}")


def decode_all(engine, prompt: list[int], max_new_tokens: int, policy=None, **settings):
    """Every token `engine.decode` yields, and the GenerationStats it returns: the one
    oracle the lossless tests compare speculative and plain decoding with."""
    from spirit.engine import DecodeSettings

    out: list[int] = []
    decoding = engine.decode(list(prompt), DecodeSettings(max_new_tokens=max_new_tokens, **settings), policy)
    while True:
        try:
            out.extend(next(decoding))
        except StopIteration as end:
            return out, end.value
