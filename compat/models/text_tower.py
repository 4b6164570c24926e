"""The query side of a CLIP checkpoint without torch: its text tower run in numpy, read from the checkpoint's
own ``model.safetensors`` (text tensors only, after the weights' sha256 is checked against the sidecar).

A one-shot ``compatflow search`` embeds a few words: importing torch and open_clip and building the whole
network (the image tower included) costs seconds, the text tower's arithmetic milliseconds. open_clip's
standard text transformer (token and position embeddings, pre-norm residual attention blocks with a causal
mask, exact GELU, a final LayerNorm, the end-of-text token's features projected) and its CLIP BPE tokenizer
(``SimpleTokenizer``, clean ``lower``) are restated here; a config that changes any of it
(:func:`unsupported`) is served by the full model (:func:`compat.production.load_encoder`), and a test holds
the two to the same vectors. Written here, not taken from open_clip, because open_clip's tokenizer and text
tower import torch.
"""

from __future__ import annotations

import gzip
import html
import itertools
import json
from collections.abc import Sequence
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np

from compat.models.checkpoint import SIDECAR_FILE, ChecksumError, read_sidecar, verified_weights
from compat.models.factory import CLIP_BPE, _open_clip_config_dir, read_config

TEXT_KEYS = frozenset({"context_length", "vocab_size", "width", "heads", "layers", "mlp_ratio"})
DEFAULTS = {"no_causal_mask": False, "pool_type": "argmax", "proj_bias": False, "proj_type": "linear"}
IGNORED_TOP_KEYS = frozenset({"embed_dim", "vision_cfg", "text_cfg", "preprocess_cfg", "pretrained"})
IGNORED_TOP_KEYS |= {"open_clip_model", "init_logit_scale", "init_logit_bias"}
LN_EPS = 1e-5  # torch.nn.LayerNorm's
# Compatible-model methods that serve queries with their "new" part's plain text tower, no adapter on top
# (compat.methods.none.PlainModel and its subclasses; tests/unit/test_text_tower.py holds the two together).
PLAIN_TEXT_METHODS = frozenset({"none", "bct"})
COMPAT_FILE = "compat.json"  # compat.methods.contract.COMPAT_FILE (that module imports torch)


def unsupported(config: dict[str, Any]) -> str | None:
    """Why the text tower of a model config is not the one restated here; None when it is."""
    text = config.get("text_cfg") or {}
    extra = sorted(set(text) - TEXT_KEYS - set(DEFAULTS))
    changed = sorted(k for k, v in DEFAULTS.items() if text.get(k, v) != v)
    top = sorted(k for k, v in config.items() if k not in IGNORED_TOP_KEYS and v not in (None, False))
    if extra or changed or top:
        return f"text_cfg {extra + changed} or model settings {top} change the text tower"
    return None


def text_checkpoint(model_dir: str | Path) -> Path | None:
    """The plain checkpoint whose text tower serves a model directory's queries: the directory itself (a
    checkpoint), or a compatible model's ``new`` part when its method adds nothing to the query side
    (:data:`PLAIN_TEXT_METHODS`); None when the queries need the full model."""
    root = Path(model_dir)
    if (root / SIDECAR_FILE).is_file():
        return root
    compat = root / COMPAT_FILE
    if not compat.is_file():
        return None
    doc = json.loads(compat.read_text())
    if doc.get("method") in PLAIN_TEXT_METHODS and doc.get("parts") == ["new"] and not doc.get("adapters"):
        part = root / "new"
        recorded = (doc.get("parts_sha256") or {}).get("new")
        if recorded and read_sidecar(part)["sha256"] != recorded:
            raise ChecksumError(
                f"{part}: its weights are not the ones {compat} was saved with (sha256 differs)"
            )
        return part
    return None


def load_text_tower(model_dir: str | Path) -> TextTower | None:
    """The numpy text tower serving a model directory's queries; None when its queries need the full model
    (a method with adapters, a text tower this module does not restate, weights it cannot read as numpy).
    Raises :class:`~compat.models.checkpoint.ChecksumError` when the weights differ from their sidecar."""
    checkpoint = text_checkpoint(model_dir)
    if checkpoint is None:
        return None
    sidecar = read_sidecar(checkpoint)
    config = read_config(sidecar["config_name"])
    if sidecar["tokenizer"] != CLIP_BPE or unsupported(config):
        return None
    weights = verified_weights(checkpoint / SIDECAR_FILE, sidecar)
    from safetensors import safe_open

    with safe_open(str(weights), framework="np") as fh:
        names = [
            n for n in fh.keys() if not n.startswith("visual.") and n not in ("logit_scale", "logit_bias")
        ]
        try:
            tensors = {name: fh.get_tensor(name).astype(np.float32) for name in names}
        except (TypeError, ValueError):  # a dtype numpy lacks (bfloat16): the full model reads it
            return None
    if tensors.get("text_projection") is None or tensors["text_projection"].ndim != 2:
        return None
    return TextTower(tensors, config["text_cfg"])


class TextTower:
    """open_clip's CLIP text encoder in numpy: texts -> L2-normalised float32 vectors [N, embed_dim]."""

    def __init__(self, tensors: dict[str, np.ndarray], text_cfg: dict[str, Any]) -> None:
        self.tensors = tensors
        self.heads = int(text_cfg.get("heads", 8))
        self.layers = int(text_cfg.get("layers", 12))
        self.context_length = int(text_cfg.get("context_length", 77))
        self.tokenizer = ClipTokenizer(self.context_length)

    def encode_texts(self, texts: Sequence[str]) -> np.ndarray:
        tokens = self.tokenizer(list(texts))
        t = self.tensors
        x = t["token_embedding.weight"][tokens] + t["positional_embedding"][: tokens.shape[1]]
        length = tokens.shape[1]
        mask = np.triu(np.full((length, length), -np.inf, dtype=np.float32), 1)
        for i in range(self.layers):
            p = f"transformer.resblocks.{i}."
            x = x + self._attention(_layer_norm(x, t[p + "ln_1.weight"], t[p + "ln_1.bias"]), p, mask)
            h = _layer_norm(x, t[p + "ln_2.weight"], t[p + "ln_2.bias"])
            h = _gelu(h @ t[p + "mlp.c_fc.weight"].T + t[p + "mlp.c_fc.bias"])
            x = x + h @ t[p + "mlp.c_proj.weight"].T + t[p + "mlp.c_proj.bias"]
        x = _layer_norm(x, t["ln_final.weight"], t["ln_final.bias"])
        pooled = x[np.arange(len(tokens)), tokens.argmax(axis=-1)] @ t["text_projection"]
        norms = np.maximum(np.linalg.norm(pooled, axis=-1, keepdims=True), 1e-12)  # torch's F.normalize
        return (pooled / norms).astype(np.float32)

    def _attention(self, x: np.ndarray, prefix: str, mask: np.ndarray) -> np.ndarray:
        t = self.tensors
        batch, length, width = x.shape
        qkv = x @ t[prefix + "attn.in_proj_weight"].T + t[prefix + "attn.in_proj_bias"]
        head = width // self.heads
        q, k, v = (
            part.reshape(batch, length, self.heads, head).transpose(0, 2, 1, 3)
            for part in np.split(qkv, 3, -1)
        )
        scores = q @ k.transpose(0, 1, 3, 2) / np.sqrt(head) + mask
        scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
        out = (scores / scores.sum(axis=-1, keepdims=True)) @ v
        out = out.transpose(0, 2, 1, 3).reshape(batch, length, width)
        return out @ t[prefix + "attn.out_proj.weight"].T + t[prefix + "attn.out_proj.bias"]


def _layer_norm(x: np.ndarray, weight: np.ndarray, bias: np.ndarray) -> np.ndarray:
    mean = x.mean(axis=-1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
    return (x - mean) / np.sqrt(var + LN_EPS) * weight + bias


def _gelu(x: np.ndarray) -> np.ndarray:
    """Exact GELU, ``x * Phi(x)``, with erf by Abramowitz and Stegun 7.1.26 (error below 1.5e-7)."""
    z = np.abs(x) / np.sqrt(2.0)
    s = 1.0 / (1.0 + 0.3275911 * z)
    poly = s * (0.254829592 + s * (-0.284496736 + s * (1.421413741 + s * (-1.453152027 + s * 1.061405429))))
    erf = np.sign(x) * (1.0 - poly * np.exp(-z * z))
    return 0.5 * x * (1.0 + erf)


@cache
def _byte_encoder() -> dict[int, str]:
    """CLIP's reversible map of bytes to printable characters (open_clip ``bytes_to_unicode``)."""
    shown = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in shown]  # mapped to the characters from 256 on
    chars = shown + [256 + n for n in range(len(others))]
    return dict(zip(shown + others, map(chr, chars), strict=True))


@cache
def _vocabulary() -> tuple[dict[str, int], dict[tuple[str, str], int]]:
    """CLIP's BPE vocabulary and merge ranks, from open_clip's own vocabulary file."""
    merges_text = gzip.open(_open_clip_config_dir().parent / "bpe_simple_vocab_16e6.txt.gz").read().decode()
    merges = [tuple(line.split()) for line in merges_text.split("\n")[1 : 49152 - 256 - 2 + 1]]
    vocab = list(_byte_encoder().values())
    vocab += [v + "</w>" for v in vocab] + ["".join(m) for m in merges] + ["<start_of_text>", "<end_of_text>"]
    return {v: i for i, v in enumerate(vocab)}, {m: i for i, m in enumerate(merges)}


class ClipTokenizer:
    """open_clip's ``SimpleTokenizer`` (clean ``lower``, truncation), returning int64 numpy token ids."""

    def __init__(self, context_length: int) -> None:
        import regex

        self.context_length = context_length
        self.encoder, self.ranks = _vocabulary()
        self.sot, self.eot = self.encoder["<start_of_text>"], self.encoder["<end_of_text>"]
        self.cache: dict[str, str] = {}
        self.pattern = regex.compile(
            r"""<start_of_text>|<end_of_text>|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+""",
            regex.IGNORECASE,
        )

    def __call__(self, texts: list[str]) -> np.ndarray:
        result = np.zeros((len(texts), self.context_length), dtype=np.int64)
        for i, text in enumerate(texts):
            tokens = [self.sot, *self.encode(text)][: self.context_length - 1] + [self.eot]  # truncated
            result[i, : len(tokens)] = tokens
        return result

    def encode(self, text: str) -> list[int]:
        import ftfy

        text = " ".join(html.unescape(html.unescape(ftfy.fix_text(text))).strip().split()).strip().lower()
        byte_encoder = _byte_encoder()
        ids = []
        for token in self.pattern.findall(text):
            token = "".join(byte_encoder[b] for b in token.encode("utf-8"))
            ids += [self.encoder[piece] for piece in self._bpe(token).split(" ")]
        return ids

    def _bpe(self, token: str) -> str:
        if token in ("<start_of_text>", "<end_of_text>"):
            return token
        if token in self.cache:
            return self.cache[token]
        word = (*token[:-1], token[-1] + "</w>")
        while len(word) > 1:
            bigram = min(itertools.pairwise(word), key=lambda pair: self.ranks.get(pair, float("inf")))
            if bigram not in self.ranks:
                break
            merged: list[str] = []
            i = 0
            while i < len(word):
                if word[i : i + 2] == bigram:
                    merged.append(word[i] + word[i + 1])
                    i += 2
                else:
                    merged.append(word[i])
                    i += 1
            word = tuple(merged)
        self.cache[token] = " ".join(word)
        return self.cache[token]
