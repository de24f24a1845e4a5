"""Packed linear layers: PyTorch's low-bit CPU kernels as modules, and a float16 embedding table.

    layer = Int4Linear(linear.weight)   # or Int8Linear, Float16Linear; quantize() swaps them in

Each layer packs its weight once for one of PyTorch's own kernels (nothing
hand-written) and keeps the float32 interface of ``nn.Linear``:

- :class:`Float16Linear`: half-precision weights, float32 activations
  (fbgemm's ``fbgemm_linear_fp16_weight``, x86 CPUs).
- :class:`Int8Linear`: int8 weights with one scale per output channel
  (``torch._weight_int8pack_mm``).
- :class:`Int4Linear`: 4-bit weights in groups of 32 inputs, each group with
  its own scale and minimum (``torch._weight_int4pack_mm_for_cpu``): exactly
  GGUF's Q4_1 block, so a file's Q4_1 weights come back on the same grid.
- :class:`Float16Embedding`: a table looked up in float16, rows returned in
  float32 (memory, not speed).

Every packed layer is an op ``torch.compile`` captures. The int8 and int4
kernels take bfloat16 activations: their float32 path measured 4-25x slower
on this project's CPU (BENCHMARKS.md), so those layers round their input to
bfloat16 and return float32. Given many positions of a sequence at once (a
prompt), where bfloat16 arithmetic is native, the int8 and int4 layers
instead widen their weight to bfloat16 for that call and run one bfloat16
matrix product (oneDNN): from 64 positions (int8) or 256 (int4, whose
unpacking costs more) this measured faster than their kernels, 2.3-2.8x at
4,000 rows (a 4,000-token prompt: 1.4-1.5x faster prefill end to end;
BENCHMARKS.md, round seven). The weight is rounded to bfloat16 on the way
(relative error 2^-9, the size of the input's own rounding), so the two
paths differ in the last bits. The choice counts positions per sequence, T
of a (..., T, in) input, never the batch: a row's product is the same alone
or beside any other rows of its length. A 2-D input (N, in) is N sequences
of one position (a decoding step's head reads (B, C)), so every decoding
step takes the kernel however many rows it holds. A prompt left-padded to a
batch's longest one, or cut into other chunks by the server, can cross the
threshold where it alone would not. And a row's input is not the same alone and
in a batch: attention upstream rounds otherwise under another batch's padding
(SmolLM2's logits move by about 5e-5 in float32), and rounding to bfloat16
here turns that into tenths of a logit by the last layer (the README's
Generation options; docs/bench/round11-invariance).

Packed layers are for inference: a backward through one, a conversion to
another dtype or device, and (for fbgemm's opaque float16 matrix) saving,
loading, copying or pickling each raise, saying why.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnkit.cpu import cpu_capability, has_fast_bfloat16

GROUP = 32  # inputs per int4 group: GGUF's Q4_1 block


def quantize_rows(x: Tensor, scale_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """int8 codes (..., D) and a scale (...) in ``scale_dtype`` with ``codes * scale`` ~ x (..., D).

    The scale is each row's largest magnitude / 127 (at least float32's smallest
    normal, so an all-zero row keeps codes 0), rounded to ``scale_dtype`` before
    the codes are taken, so ``codes * scale`` is exactly what is read. The int8
    weight form and the int8 KV cache (:mod:`.int8_storage`) both round this way.
    """
    largest = x.detach().abs().amax(dim=-1).float()  # (..., D) -> (...)
    scale = (largest / 127).clamp_min(torch.finfo(torch.float32).tiny).to(scale_dtype)  # (...)
    codes = torch.round(x.detach().float() / scale.float()[..., None]).clamp_(-127, 127).to(torch.int8)  # (..., D)
    return codes, scale


class PackedLinear(nn.Module):
    """A linear layer whose weight is packed for one of PyTorch's low-bit kernels (inference only).

    Subclasses pack in their constructor and define :meth:`matmul` over 2-D
    input in their ``compute`` dtype; this class keeps the float32 interface.
    """

    form = "packed"
    compute = torch.bfloat16  # the dtype the kernel reads its input in
    dense_rows: int | None = None  # from this many positions per sequence, F.linear over dense_weight() (None: never)
    bias: Tensor | None

    def __init__(self, in_features: int, out_features: int, bias: Tensor | None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())

    def matmul(self, x: Tensor) -> Tensor:
        """(M, in) -> (M, out), in :attr:`compute`."""
        raise NotImplementedError

    def dense_weight(self) -> Tensor:
        """The weight (out, in) widened to :attr:`compute`, for one product over many rows (subclasses with
        :attr:`dense_rows`)."""
        raise NotImplementedError

    def forward(self, x: Tensor) -> Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"expected input (..., {self.in_features}), got {tuple(x.shape)}")
        if x.requires_grad and torch.is_grad_enabled():  # runs, but a backward through it says why it cannot
            return _NoGradient.apply(x, self)
        return self._product(x)

    def _product(self, x: Tensor) -> Tensor:
        rows = x.reshape(-1, self.in_features).to(self.compute)  # (..., in) -> (M, in)
        positions = x.shape[-2] if x.dim() > 2 else 1  # per sequence, T of (..., T, in): never the batch's size
        if self.dense_rows is not None and positions >= self.dense_rows:
            out = F.linear(rows, self.dense_weight())  # (M, in) -> (M, out): one GEMM, the weight unpacked for it
        else:
            out = self.matmul(rows)  # (M, in) -> (M, out)
        out = out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)  # (M, out) -> (..., out)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> PackedLinear:
        """``.to()``, ``.float()``, ``.cuda()`` and the like: packed buffers keep their own dtypes and the CPU.

        A conversion to float32 on the CPU (``model.float()``) leaves the layer
        as it is (a packed model already computes in float32); another dtype or
        a device is refused, naming it, instead of failing later in a kernel.
        """
        refuse_conversion(self.form, fn)
        return self


def refuse_conversion(form: str, fn: Callable[[Tensor], Tensor]) -> None:
    """Raise unless ``fn`` (what ``.to()``, ``.half()``, ``.cuda()`` apply) keeps float32 on the CPU."""
    probe = fn(torch.zeros((), dtype=torch.float32))  # what the conversion does to a float32 tensor
    if probe.device.type != "cpu":
        raise ValueError(f"a layer with {form} weights runs PyTorch's CPU kernels and cannot move to "
                         f"{probe.device}; load the model with weights='float32' to run it there")
    if probe.dtype != torch.float32:
        raise ValueError(f"a model with {form} weights computes in float32 and cannot be converted to "
                         f"{probe.dtype}; load it with weights='float32' for another dtype")


class _NoGradient(torch.autograd.Function):
    """A packed layer's product whose backward raises: packed weights have no gradient formula."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: Tensor, layer: PackedLinear) -> Tensor:
        ctx.form = layer.form  # type: ignore[attr-defined]
        return layer._product(x)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, *grads: Tensor) -> None:
        raise ValueError(f"a linear layer with {ctx.form} weights has no gradient (its weights are "  # type: ignore[attr-defined]
                         "packed for inference): load the model with weights='float32' to differentiate through it")


def _fp16_weight_product(x: Tensor, packed: Tensor, out_features: int) -> Tensor:
    """fbgemm's float16-weight product, (M, in) float32 -> (M, out) float32."""
    with warnings.catch_warnings():  # the function is marked deprecated; torch.ao's dynamic linear calls the same
        warnings.simplefilter("ignore", UserWarning)
        return torch.fbgemm_linear_fp16_weight_fp32_activation(x, packed, torch.zeros(out_features))


@torch.library.custom_op("attnkit::linear_fp16_weight", mutates_args=())
def _linear_fp16_weight(x: Tensor, packed: Tensor, out_features: int) -> Tensor:
    """The same product as an op torch.compile can capture (fbgemm's packed matrix is opaque to it)."""
    return _fp16_weight_product(x, packed, out_features)


@_linear_fp16_weight.register_fake
def _(x: Tensor, packed: Tensor, out_features: int) -> Tensor:
    return x.new_empty(x.shape[0], out_features)  # (M, in) -> (M, out)


def fits_float16(weight: Tensor) -> bool:
    """Whether float16 holds every value of ``weight`` (magnitudes up to 65504; beyond, values would clip)."""
    return weight.numel() == 0 or bool(weight.detach().abs().max() <= torch.finfo(torch.float16).max)


class Float16Linear(PackedLinear):
    """float16 weights, float32 activations: fbgemm's ``fbgemm_linear_fp16_weight`` (x86 CPUs)."""

    form = "float16"
    compute = torch.float32
    packed: Tensor  # fbgemm's packed float16 matrix (opaque)

    def __init__(self, weight: Tensor, bias: Tensor | None = None) -> None:
        if not fits_float16(weight):
            raise ValueError(f"float16 weights hold magnitudes up to {torch.finfo(torch.float16).max:g}; this "
                             f"weight reaches {float(weight.detach().abs().max()):g} (it would be clipped): keep "
                             "the layer in float32")
        super().__init__(weight.shape[1], weight.shape[0], bias)
        with warnings.catch_warnings():  # marked deprecated, as above
            warnings.simplefilter("ignore", UserWarning)
            packed = torch.fbgemm_pack_gemm_matrix_fp16(weight.detach().float().contiguous())
        # a pointer to fbgemm's C++ object in a tensor's bytes: never saved or loaded (a copied pointer is freed twice)
        self.register_buffer("packed", packed, persistent=False)

    def _refuse_copy(self, what: str) -> ValueError:
        return ValueError(f"a float16 layer (fbgemm's packed matrix, an opaque C++ object) cannot be {what}: "
                          "save or copy the float32 model and quantize() the copy (loading a GGUF file "
                          "again takes seconds)")

    def _save_to_state_dict(self, destination: dict[str, object], prefix: str, keep_vars: bool) -> None:
        raise self._refuse_copy(f"saved to a state_dict (at {prefix.rstrip('.') or 'the root'})")

    def _load_from_state_dict(self, *args: object, **kwargs: object) -> None:
        raise self._refuse_copy("loaded from a state_dict")

    def __deepcopy__(self, memo: dict[int, object]) -> Float16Linear:
        raise self._refuse_copy("deep-copied")

    def __getstate__(self) -> dict[str, object]:
        raise self._refuse_copy("pickled (torch.save of the model)")

    def matmul(self, x: Tensor) -> Tensor:
        if torch.compiler.is_compiling():
            return _linear_fp16_weight(x, self.packed, self.out_features)  # (M, in) -> (M, out), captured as an op
        # eager: the function itself (the op's first call imports torch._dynamo: 1.4 s before the first token)
        return _fp16_weight_product(x, self.packed, self.out_features)  # (M, in) -> (M, out)


class Int8Linear(PackedLinear):
    """int8 weights, one bfloat16 scale per output channel (symmetric): ``torch._weight_int8pack_mm``."""

    form = "int8"
    codes: Tensor  # int8 (out, in)
    scale: Tensor  # bfloat16 (out,)

    def __init__(self, weight: Tensor, bias: Tensor | None = None) -> None:
        if weight.shape[1] % 16:  # measured: other widths give wrong products (24, 40) or crash (12)
            raise ValueError(f"int8 weights need inputs in multiples of 16 (the kernel's), got in_features="
                             f"{weight.shape[1]}")
        super().__init__(weight.shape[1], weight.shape[0], bias)
        codes, scale = quantize_rows(weight, torch.bfloat16)  # (out, in) int8, (out,) bfloat16
        codes = codes.contiguous()  # the kernel takes contiguous weights (a weight may be a transposed view)
        self.register_buffer("codes", codes)
        self.register_buffer("scale", scale)
        self.dense_rows = 64 if has_fast_bfloat16() else None  # measured: faster than the kernel from 32-64 rows

    def matmul(self, x: Tensor) -> Tensor:
        return torch._weight_int8pack_mm(x, self.codes, self.scale)  # (M, in) -> (M, out)

    def dense_weight(self) -> Tensor:
        return self.codes * self.scale[:, None]  # (out, in) int8 * (out, 1) bfloat16 -> bfloat16, one allocation


class Float16Embedding(nn.Module):
    """An embedding table kept in float16 whose rows come back in float32 (inference only).

    A lookup reads one row per token, so the table's bytes are memory, not
    speed: packed models keep theirs in half the bytes (SmolLM2's 49,152 x
    576 table: 113 MB in float32).
    """

    form = "float16"
    table: Tensor  # float16 (V, C)

    def __init__(self, weight: Tensor) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = weight.shape
        self.register_buffer("table", weight.detach().to(torch.float16))

    def forward(self, input_ids: Tensor) -> Tensor:
        return F.embedding(input_ids, self.table).float()  # (...) -> (..., C)

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> Float16Embedding:
        """As a packed layer's: ``model.float()`` keeps the table in float16 (it widened it to float32, twice
        the memory, under a label still saying float16); another dtype or a device is refused; what keeps
        float16 as it is (``share_memory()``) is applied."""
        refuse_conversion(self.form, fn)
        if fn(torch.zeros((), dtype=torch.float16)).dtype == torch.float16:
            return super()._apply(fn, recurse)
        return self

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, float16"


def float16_table(module: nn.Module, _: str) -> nn.Module | None:
    """A :class:`Float16Embedding` for a plain float32 ``nn.Embedding``; None for anything else.

    Left as they are: subclasses (their forward may do more, e.g. scale), tables
    with ``max_norm`` (renormalised on lookup), and tables float16 cannot hold.
    """
    if type(module) is not nn.Embedding or module.max_norm is not None or module.weight.dtype != torch.float32:
        return None
    return Float16Embedding(module.weight) if fits_float16(module.weight) else None


def int4_grid(weight: Tensor, dtype: torch.dtype = torch.bfloat16) -> tuple[Tensor, Tensor, Tensor]:
    """Asymmetric 4-bit codes of ``weight`` (out, in) in groups of 32 inputs: Q4_1's grid.

    Returns codes int32 (out, in) in 0..15, scale and minimum (out, in / 32)
    in ``dtype``, with weight ~= minimum + codes * scale per group.
    """
    out_features, in_features = weight.shape
    groups = weight.detach().float().reshape(out_features, in_features // GROUP, GROUP)  # (N, K) -> (N, K/32, 32)
    low, high = groups.amin(dim=2), groups.amax(dim=2)  # (N, K/32)
    scale = ((high - low) / 15).clamp_min(torch.finfo(torch.float32).tiny).to(dtype)  # (N, K/32)
    low = low.to(dtype)
    codes = torch.round((groups - low.float()[..., None]) / scale.float()[..., None]).clamp_(0, 15)  # (N, K/32, 32)
    return codes.to(torch.int32).reshape(out_features, in_features), scale, low


class Int4Linear(PackedLinear):
    """4-bit weights in groups of 32 inputs with a scale and minimum each: ``torch._weight_int4pack_mm_for_cpu``."""

    form = "int4"
    packed: Tensor  # uint8 (out, in / 2), the kernel's tiles
    scale_zero: Tensor  # bfloat16 (in / 32, out, 2)

    def __init__(self, weight: Tensor, bias: Tensor | None = None, *,
                 grid: tuple[Tensor, Tensor, Tensor] | None = None) -> None:
        out_features, in_features = weight.shape
        if not int4_fits(out_features, in_features):
            raise ValueError(f"int4 weights need inputs in groups of {GROUP} and outputs in multiples of 16 (the "
                             f"kernel's tiles), got in_features={in_features}, out_features={out_features}")
        super().__init__(in_features, out_features, bias)
        # (N, K), (N, K/32), (N, K/32): the weight's own grid, or one given (a file's Q4_1 blocks; weight unread)
        if grid is not None and tuple(grid[0].shape) != (out_features, in_features):
            raise ValueError(f"an int4 grid of codes {tuple(grid[0].shape)} for a ({out_features}, {in_features}) "
                             "weight: it is another layer's")
        codes, scale, low = int4_grid(weight) if grid is None else grid
        scale, low = scale.to(torch.bfloat16), low.to(torch.bfloat16)
        # the kernel reads w = (code - 8) * scale + zero: zero = low + 8 * scale, per group (K/32, N, 2)
        zero = (low.float() + 8 * scale.float()).to(torch.bfloat16)
        self.register_buffer("packed", torch._convert_weight_to_int4pack_for_cpu(codes, 1))  # (N, K / 2) uint8
        self.register_buffer("scale_zero", torch.stack([scale, zero], dim=2).transpose(0, 1).contiguous())
        unpacks = has_fast_bfloat16() and reads_int4_tiles(out_features)
        self.dense_rows = 256 if unpacks else None  # measured: faster than the kernel from 128-256 rows (unpacking)

    def matmul(self, x: Tensor) -> Tensor:
        return torch._weight_int4pack_mm_for_cpu(x, self.packed, GROUP, self.scale_zero)  # (M, K) -> (M, N)

    def dense_weight(self) -> Tensor:
        codes = unpack_int4(self.packed, self.out_features, self.in_features)  # (K, N) uint8
        codes = codes.view(self.in_features // GROUP, GROUP, self.out_features)  # (K/32, 32, N)
        scale = self.scale_zero[..., 0].float()  # (K/32, N)
        low = self.scale_zero[..., 1].float() - 8 * scale  # (K/32, N): w = low + code * scale
        weight = torch.addcmul(low[:, None], codes.float(), scale[:, None])  # (K/32, 32, N)
        return weight.to(torch.bfloat16).view(self.in_features, self.out_features).T  # (K, N) -> (N, K) view


_TILES_READ: dict[int, bool] = {}  # out_features % 64 -> whether unpack_int4 reads this PyTorch's tiles


def reads_int4_tiles(out_features: int) -> bool:
    """Whether :func:`unpack_int4` reads back what ``torch._convert_weight_to_int4pack_for_cpu`` packs, for
    layers of ``out_features`` outputs (their last block of 16, 32 or 48 is laid out apart): tried once per
    process and remainder on fixed codes, every position distinct."""
    rest = out_features % 64
    if rest not in _TILES_READ:
        n, k = 128 + rest, 64  # two full blocks and the remainder
        codes = torch.randint(0, 16, (n, k), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
        packed = torch._convert_weight_to_int4pack_for_cpu(codes, 1)  # (n, k / 2) uint8
        _TILES_READ[rest] = torch.equal(unpack_int4(packed, n, k), codes.T.to(torch.uint8))
    return _TILES_READ[rest]


def unpack_int4(packed: Tensor, out_features: int, in_features: int) -> Tensor:
    """The codes (in, out) uint8 in 0..15 of ``torch._convert_weight_to_int4pack_for_cpu``'s tiles.

    The outputs go in blocks of 64 (PyTorch's AVX512 kernels) or 32 (its AVX2
    ones); per block and input, one byte per pair of outputs: byte j holds
    output j (low nibble) and output j + block / 2 (high). A last block of 16,
    32 or 48 outputs holds pairs: byte j has outputs 2j and 2j + 1. (Other
    CPU builds lay them out otherwise: :class:`Int4Linear` relies on it only
    where :func:`reads_int4_tiles`.)
    """
    block = 64 if cpu_capability() == "AVX512" else 32
    full = out_features // block * block
    flat = packed.reshape(-1)  # (N * K / 2,) bytes in the kernel's order
    blocks = flat[: full * in_features // 2].view(full // block, in_features, block // 2)  # (N/b, K, b/2)
    blocks = torch.stack([blocks & 15, blocks >> 4], dim=2)  # (N/b, K, 2, b/2): outputs j, j + b/2
    blocks = blocks.permute(1, 0, 2, 3).reshape(in_features, full)  # (K, N/b, 2, b/2) -> (K, full)
    if full == out_features:
        return blocks
    rest = flat[full * in_features // 2 :].view(in_features, (out_features - full) // 2)  # (K, r/2)
    rest = torch.stack([rest & 15, rest >> 4], dim=2).reshape(in_features, out_features - full)  # (K, r)
    return torch.cat([blocks, rest], dim=1)  # (K, N)


def int4_fits(out_features: int, in_features: int) -> bool:
    """Whether the int4 kernel's tiles fit a layer: inputs in groups of 32, outputs in multiples of 16."""
    return in_features % GROUP == 0 and out_features % 16 == 0
