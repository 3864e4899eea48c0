"""Typed, hashable descriptions of what a scheme quantizes and how: ``WeightSpec``, ``ActivationSpec`` and
``LayoutSpec``.

They are frozen dataclasses so a ``Scheme`` holding them stays hashable and can be a static argument
under jit. Bits, symmetry and group sizes are fields, checked against the format when it is a known one;
nothing is read back out of a format's name. A group size of None means one group per output channel,
the only encoding of that case (HF configs' -1 is translated where the config is read).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any

from jquant.formats.bnb_int8 import DEFAULT_THRESHOLD
from jquant.formats.fp8 import FP8_DTYPES, WEIGHT_GRANULARITIES
from jquant.formats.integer import BITS, int_format

ACTIVATION_MODES = ("none", "dynamic_per_tensor", "dynamic_per_token", "dynamic_per_token_group", "static", "llm_int8")
ACTIVATION_FORMATS = (*FP8_DTYPES, "int8")
INT8_ACTIVATION_MODES = ("dynamic_per_token", "static", "llm_int8")

# Known formats → (family, bits). Integer names are built from their (bits, symmetric) fields.
_INT_FORMATS = {int_format(b, s): (b, s) for b in BITS for s in (True, False)}
_FAMILIES = {**{f: ("int", b) for f, (b, _) in _INT_FORMATS.items()},
             **{f: ("fp8", 8) for f in FP8_DTYPES},
             "mxfp4": ("mx", 4), "mxfp8_e4m3": ("mx", 8), "mxfp8_e5m2": ("mx", 8),
             "nvfp4": ("nvfp4", 4), "nf4": ("bnb", 4), "fp4_bnb": ("bnb", 4), "int8_bnb": ("bnb8", 8)}
# The WeightSpec option fields each family's quantizer takes (symmetric is checked on its own).
_OPTION_FIELDS = ("group_size", "scale_dtype", "granularity", "block_size", "ue8m0", "scale_mode",
                  "element_rounding", "convention", "blocksize", "double_quant")
_FAMILY_OPTIONS = {"int": ("group_size", "scale_dtype"), "fp8": ("granularity", "block_size", "ue8m0"),
                   "mx": ("scale_mode", "element_rounding"), "nvfp4": ("convention",),
                   "bnb": ("blocksize", "double_quant"), "bnb8": ()}
# WeightSpec field → the quantizer's keyword, where the names differ.
_KWARG_NAMES = {"double_quant": "compress_statistics"}


def _positive_int(value, what: str, *, none_hint: str = "") -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{what} must be a positive int{none_hint}, got {value!r}")


def _optional(value, types, what: str) -> None:
    if value is not None and not isinstance(value, types):
        names = " or ".join(t.__name__ for t in (types if isinstance(types, tuple) else (types,)))
        raise TypeError(f"{what} must be {names} or None, got {value!r}")


@dataclasses.dataclass(frozen=True)
class WeightSpec:
    """How a weight ``[N, K]`` is quantized along K.

    Attributes:
      format: a ``jquant.formats.formats()`` name (``"int4"``, ``"fp8_e4m3"``, ``"nf4"``, ...).
      bits: bits per code (checked against ``format`` when it is a known one).
      symmetric: integer formats: True for codes around zero, False for zero points; None elsewhere.
      group_size: integer formats: values per scale along K; None is one group per output channel.
      scale_dtype: integer formats: dtype the scales are stored in (GPTQ/AWQ store ``"float16"``).
      granularity: FP8: ``"tensor"``, ``"channel"`` or ``"block"``.
      block_size: FP8 block: ``(rows, cols)`` of one scale block.
      ue8m0: FP8 block: power-of-two scales.
      scale_mode: MX formats: how the shared exponent is chosen (``"floor"``, ...).
      element_rounding: MX formats: how elements round (``"even"``, ``"ggml"``, ``"compressed-tensors"``).
      convention: NVFP4: ``"compressed-tensors"`` or ``"modelopt"`` global-scale convention.
      blocksize: bitsandbytes: values per absmax.
      double_quant: bitsandbytes: absmax values themselves quantized to 8 bits.

    Examples:
      >>> from jquant import WeightSpec
      >>> spec = WeightSpec.integer(4, 128, symmetric=False, scale_dtype="float16")
      >>> spec.format, spec.family
      ('uint4', 'int')
      >>> spec.quantize_kwargs()  # the options jquant.quantize(w, spec.format, axis=1, ...) takes
      {'group_size': 128, 'scale_dtype': 'float16'}
      >>> WeightSpec("fp8_e4m3", 8, granularity="block", block_size=(128, 128)).quantize_kwargs()
      {'granularity': 'block', 'block_size': (128, 128), 'ue8m0': False}
      >>> WeightSpec("nvfp4", 8)
      Traceback (most recent call last):
          ...
      ValueError: WeightSpec: format 'nvfp4' has 4-bit codes, got bits=8
    """

    format: str
    bits: int
    symmetric: bool | None = None
    group_size: int | None = None
    scale_dtype: str | None = None
    granularity: str | None = None
    block_size: tuple[int, int] | None = None
    ue8m0: bool | None = None
    scale_mode: str | None = None
    element_rounding: str | None = None
    convention: str | None = None
    blocksize: int | None = None
    double_quant: bool | None = None

    def __post_init__(self):
        if not isinstance(self.format, str) or not self.format:
            raise TypeError(f"WeightSpec.format must be a format name, got {self.format!r}")
        if isinstance(self.bits, bool) or not isinstance(self.bits, int) or self.bits <= 0:
            raise ValueError(f"WeightSpec.bits must be a positive int, got {self.bits!r}")
        _positive_int(self.group_size, "WeightSpec.group_size", none_hint=" (None: one group per output channel)")
        _positive_int(self.blocksize, "WeightSpec.blocksize")
        for name, types in (("symmetric", bool), ("ue8m0", bool), ("double_quant", bool), ("scale_dtype", str),
                            ("granularity", str), ("scale_mode", str), ("element_rounding", str),
                            ("convention", str)):
            _optional(getattr(self, name), types, f"WeightSpec.{name}")
        if self.block_size is not None:
            block = tuple(self.block_size)  # a list from JSON or a config: kept hashable
            if len(block) != 2:
                raise ValueError(f"WeightSpec.block_size must be two positive ints, got {self.block_size!r}")
            for b in block:
                _positive_int(b, "WeightSpec.block_size entries")
            object.__setattr__(self, "block_size", block)
        family, bits = _FAMILIES.get(self.format, (None, None))
        if bits is not None and self.bits != bits:
            raise ValueError(f"WeightSpec: format {self.format!r} has {bits}-bit codes, got bits={self.bits}")
        if family == "int" and (self.symmetric is None or int_format(self.bits, self.symmetric) != self.format):
            want = _INT_FORMATS[self.format][1]
            raise ValueError(f"WeightSpec: format {self.format!r} needs symmetric={want}, got {self.symmetric!r}")
        if family is not None:
            allowed = _FAMILY_OPTIONS[family] + (("symmetric",) if family == "int" else ())
            extra = [f for f in _OPTION_FIELDS + ("symmetric",) if getattr(self, f) is not None and f not in allowed]
            if extra:
                raise ValueError(f"WeightSpec: {', '.join(extra)} do not apply to format {self.format!r} "
                                 f"(it takes {', '.join(allowed)})")
        if family == "fp8":
            if self.granularity is not None and self.granularity not in WEIGHT_GRANULARITIES:
                raise ValueError(f"WeightSpec.granularity must be one of {WEIGHT_GRANULARITIES}, "
                                 f"got {self.granularity!r}")
            if (self.granularity == "block") != (self.block_size is not None):
                raise ValueError("WeightSpec: block_size goes with granularity='block' (and only with it), got "
                                 f"granularity={self.granularity!r}, block_size={self.block_size!r}")
            if self.granularity == "block" and self.ue8m0 is None:
                object.__setattr__(self, "ue8m0", False)

    @property
    def family(self) -> str | None:
        """``"int"``, ``"fp8"``, ``"mx"``, ``"nvfp4"``, ``"bnb"`` or ``"bnb8"``; None for a format not known here."""
        return _FAMILIES.get(self.format, (None,))[0]

    @classmethod
    def integer(cls, bits: int, group_size: int | None, *, symmetric: bool = True,
                scale_dtype: str | None = None) -> "WeightSpec":
        """An integer weight: ``int{bits}`` (symmetric) or ``uint{bits}`` (zero points)."""
        return cls(int_format(bits, symmetric), bits, symmetric=symmetric, group_size=group_size,
                   scale_dtype=scale_dtype)

    def quantize_kwargs(self) -> dict[str, Any]:
        """The keyword options ``jquant.formats.quantize(w, self.format, axis=1, **options)`` takes."""
        family = self.family
        fields = _FAMILY_OPTIONS[family] if family is not None else _OPTION_FIELDS
        # Integer quantizers are always told the group size: None asks for per-channel scales.
        return {_KWARG_NAMES.get(f, f): getattr(self, f) for f in fields
                if getattr(self, f) is not None or (family == "int" and f == "group_size")}


@dataclasses.dataclass(frozen=True)
class ActivationSpec:
    """How activations are quantized before the GEMM.

    Attributes:
      mode: one of ``ACTIVATION_MODES`` (``"none"``: weight-only, activations stay in float).
      format: format of the quantized activations: FP8 (``"fp8_e4m3"`` unless given) or ``"int8"``
        (symmetric, per token or static; ``"llm_int8"`` is int8 only); None when ``"none"``.
      group_size: ``"dynamic_per_token_group"``: values per scale along K.
      ue8m0: ``"dynamic_per_token_group"``: power-of-two scales.
      input_scale: ``"static"``: a calibrated per-tensor scale used where no per-weight one is passed.
      outlier_threshold: ``"llm_int8"`` (bitsandbytes' LLM.int8(), with ``"int8_bnb"`` weights): columns of
        x holding a value of magnitude at least this run in float, the rest in int8 per token; 0 runs
        every column in int8. Default 6.0, bitsandbytes' ``llm_int8_threshold``.

    Examples:
      >>> from jquant import ActivationSpec
      >>> ActivationSpec().mode  # weight-only
      'none'
      >>> ActivationSpec("dynamic_per_token").format  # FP8 E4M3 unless told otherwise
      'fp8_e4m3'
      >>> ActivationSpec("static", input_scale=1).input_scale
      1.0
      >>> ActivationSpec("dynamic_per_token", group_size=128)
      Traceback (most recent call last):
          ...
      ValueError: ActivationSpec: group_size goes with mode 'dynamic_per_token_group' (and only with it), ...
    """

    mode: str = "none"
    format: str | None = None
    group_size: int | None = None
    ue8m0: bool = False
    input_scale: float | None = None
    outlier_threshold: float | None = None

    def __post_init__(self):
        if self.mode not in ACTIVATION_MODES:
            raise ValueError(f"activation must be one of {ACTIVATION_MODES}, got {self.mode!r}")
        _positive_int(self.group_size, "ActivationSpec.group_size")
        if not isinstance(self.ue8m0, bool):
            raise TypeError(f"ActivationSpec.ue8m0 must be a bool, got {self.ue8m0!r}")
        if self.mode == "none":
            if (self.format, self.group_size, self.ue8m0, self.input_scale, self.outlier_threshold) \
                    != (None, None, False, None, None):
                raise ValueError("ActivationSpec: mode 'none' (weight-only) takes no format, group_size, ue8m0, "
                                 "input_scale or outlier_threshold")
            return
        if self.mode == "llm_int8":
            if self.format is None:
                object.__setattr__(self, "format", "int8")
            self._check_outlier_threshold()
        elif self.outlier_threshold is not None:
            raise ValueError(f"ActivationSpec: outlier_threshold applies to mode 'llm_int8', not {self.mode!r}")
        if self.format is None:
            object.__setattr__(self, "format", "fp8_e4m3")
        if self.format not in ACTIVATION_FORMATS:
            raise ValueError(f"ActivationSpec.format must be one of {ACTIVATION_FORMATS}, got {self.format!r}")
        if self.mode == "llm_int8" and self.format != "int8":
            raise ValueError(f"ActivationSpec: mode 'llm_int8' quantizes to int8, got format={self.format!r}")
        if self.format == "int8" and self.mode not in INT8_ACTIVATION_MODES:
            raise ValueError(f"ActivationSpec: int8 activations are quantized {INT8_ACTIVATION_MODES} (symmetric, "
                             f"as vLLM's W8A8 INT8 path), got mode={self.mode!r}")
        if (self.mode == "dynamic_per_token_group") != (self.group_size is not None):
            raise ValueError(f"ActivationSpec: group_size goes with mode 'dynamic_per_token_group' (and only with "
                             f"it), got mode={self.mode!r}, group_size={self.group_size!r}")
        if self.ue8m0 and self.mode != "dynamic_per_token_group":
            raise ValueError(f"ActivationSpec: ue8m0 applies to mode 'dynamic_per_token_group', not {self.mode!r}")
        if self.input_scale is not None:
            if self.mode != "static":
                raise ValueError(f"ActivationSpec: input_scale applies to mode 'static', not {self.mode!r}")
            if isinstance(self.input_scale, bool) or not isinstance(self.input_scale, numbers.Real):
                raise TypeError(f"ActivationSpec.input_scale must be a float, got {self.input_scale!r}")
            scale = float(self.input_scale)
            if not math.isfinite(scale) or scale <= 0:
                raise ValueError(f"ActivationSpec.input_scale must be positive and finite, got {scale}")
            object.__setattr__(self, "input_scale", scale)

    def _check_outlier_threshold(self) -> None:
        threshold = DEFAULT_THRESHOLD if self.outlier_threshold is None else self.outlier_threshold
        if isinstance(threshold, bool) or not isinstance(threshold, numbers.Real):
            raise TypeError(f"ActivationSpec.outlier_threshold must be a float, got {threshold!r}")
        if not math.isfinite(threshold) or threshold < 0:
            raise ValueError(f"ActivationSpec.outlier_threshold must be finite and >= 0, got {threshold}")
        object.__setattr__(self, "outlier_threshold", float(threshold))


@dataclasses.dataclass(frozen=True)
class LayoutSpec:
    """Options of a scheme's checkpoint layout that its tensors do not carry (``to_checkpoint`` and
    ``from_checkpoint`` keywords).

    Attributes:
      checkpoint_format: GPTQ: ``"gptq"`` (zero points stored minus one) or ``"gptq_v2"``.
      desc_act: GPTQ: act-order checkpoints (a ``g_idx`` per input row).

    Examples:
      >>> from jquant import LayoutSpec
      >>> LayoutSpec(checkpoint_format="gptq_v2").kwargs()
      {'checkpoint_format': 'gptq_v2'}
      >>> LayoutSpec().kwargs()
      {}
    """

    checkpoint_format: str | None = None
    desc_act: bool | None = None

    def __post_init__(self):
        _optional(self.checkpoint_format, str, "LayoutSpec.checkpoint_format")
        _optional(self.desc_act, bool, "LayoutSpec.desc_act")

    def kwargs(self) -> dict[str, Any]:
        """The options that are set, as ``to_checkpoint`` / ``from_checkpoint`` keywords."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) is not None}


def weight_spec_from_options(fmt: str, options: dict[str, Any]) -> WeightSpec:
    """A WeightSpec from a format and ``quantize`` options (what schemes saved before the typed specs hold).

    Bits and symmetry come from the format tables above, never from parsing the name.

    Examples:
      >>> from jquant.schemes.spec import weight_spec_from_options
      >>> spec = weight_spec_from_options("uint4", {"group_size": 128})
      >>> spec.bits, spec.symmetric, spec.group_size
      (4, False, 128)
      >>> weight_spec_from_options("nf4", {"blocksize": 64, "compress_statistics": True}).double_quant
      True
    """
    if fmt not in _FAMILIES:
        raise ValueError(f"cannot tell the bits of format {fmt!r}; build a WeightSpec with bits= instead")
    family, bits = _FAMILIES[fmt]
    names = {v: k for k, v in _KWARG_NAMES.items()}
    fields = {names.get(k, k): (tuple(v) if k == "block_size" and v is not None else v) for k, v in options.items()}
    if family == "int":
        fields["symmetric"] = _INT_FORMATS[fmt][1]
    return WeightSpec(fmt, bits, **fields)


__all__ = ["ACTIVATION_MODES", "ActivationSpec", "LayoutSpec", "WeightSpec", "weight_spec_from_options"]
