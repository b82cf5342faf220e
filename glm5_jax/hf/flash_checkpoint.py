"""A GLM-5.3-Flash hub checkpoint seen as its language model in the GLM-5 key layout.

`Glm5NextForConditionalGeneration` saves the language model under ``model.language_model.`` and the
vision tower under ``model.visual.``; a flat text-only checkpoint uses ``model.`` directly. The view
renames the former to the latter and leaves out what this model does not build, naming it: the vision
tower (out of scope) and the MTP layer ``model.layers.{num_hidden_layers}.*``, which transformers'
Glm5Next ignores as well (so there is no reference to check one against).
"""
from __future__ import annotations

import logging

from glm5_jax.checkpoint.errors import CheckpointError

LANGUAGE_PREFIX = "model.language_model."
VISION_PREFIXES = ("model.visual.", "visual.")

log = logging.getLogger(__name__)


def text_key(name: str) -> str:
    """A hub key in the text-only (``model.``) layout."""
    return "model." + name[len(LANGUAGE_PREFIX):] if name.startswith(LANGUAGE_PREFIX) else name


class TextOnlyCheckpoint:
    """The language-model tensors of ``ckpt`` (a `SafetensorsCheckpoint`) under text-only keys; ``skipped``
    lists what was left out, by reason ("vision", "mtp")."""

    def __init__(self, ckpt, num_hidden_layers: int):
        self.inner, self.dir = ckpt, ckpt.dir
        self.source: dict[str, str] = {}
        self.skipped: dict[str, list[str]] = {"vision": [], "mtp": []}
        mtp_prefix = f"model.layers.{num_hidden_layers}."
        for name in ckpt.keys():
            key = text_key(name)
            if name.startswith(VISION_PREFIXES):
                self.skipped["vision"].append(name)
            elif key.startswith(mtp_prefix):
                self.skipped["mtp"].append(name)
            else:
                self.source[key] = name

    def report(self) -> str:
        """One line saying what was skipped (empty when nothing was)."""
        parts = []
        if self.skipped["vision"]:
            parts.append(f"{len(self.skipped['vision'])} vision-tower tensors (model.visual.*: the vision tower is "
                         "not built, only the language model)")
        if self.skipped["mtp"]:
            parts.append(f"{len(self.skipped['mtp'])} MTP-layer tensors (transformers' Glm5Next has no MTP layer)")
        return f"{self.dir}: skipped " + "; ".join(parts) if parts else ""

    def _source(self, name):
        try:
            return self.source[name]
        except KeyError:
            raise CheckpointError(f"{self.dir}: missing tensor {name!r}") from None

    def keys(self):
        return self.source.keys()

    def __contains__(self, name):
        return name in self.source

    def shape(self, name):
        return self.inner.shape(self._source(name))

    def dtype(self, name):
        return self.inner.dtype(self._source(name))

    def raw(self, name):
        return self.inner.raw(self._source(name))

    def read_rows(self, name, rows, out=None):
        return self.inner.read_rows(self._source(name), rows, out)

    def get(self, name, block_size=(128, 128)):
        return self.inner.get(self._source(name), block_size)


def export_key_fn(hf: dict):
    """hub key -> the key an export writes: a nested glm5_next config.json (`Glm5NextForConditionalGeneration`)
    puts the language model under ``model.language_model.``; anything else keeps the key."""
    from glm5_jax.hf.flash_config import MODEL_TYPES

    if hf.get("model_type") not in MODEL_TYPES or "text_config" not in hf:
        return lambda key: key
    return lambda key: LANGUAGE_PREFIX + key[len("model."):] if key.startswith("model.") else key


def open_text_only(ckpt, cfg, model_type: str | None):
    """``ckpt`` as `TextOnlyCheckpoint` for a GLM-5.3-Flash checkpoint (logging what it skips), else itself."""
    from glm5_jax.hf.flash_config import MODEL_TYPES

    if model_type not in MODEL_TYPES:
        return ckpt
    view = TextOnlyCheckpoint(ckpt, cfg.num_hidden_layers)
    if view.report():
        log.warning(view.report())
    return view
