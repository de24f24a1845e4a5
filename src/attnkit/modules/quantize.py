"""Weights in fewer bytes: every ``nn.Linear`` of a model swapped for a packed form.

    model = quantize(load_smollm2(), "int4")   # or load_smollm2(weights="int4")

Decoding reads every weight once per token, so its speed follows the bytes it
reads. The forms are PyTorch's own kernels, swapped in as modules: nothing
hand-written.

- ``"float32"``: the weights as they are.
- ``"float16"``: half-precision weights, float32 activations (fbgemm's
  ``fbgemm_linear_fp16_weight``, x86 CPUs): half the bytes.
- ``"int8"``: int8 weights with one scale per output channel
  (``torch._weight_int8pack_mm``): a quarter of the bytes.
- ``"int4"``: 4-bit weights in groups of 32 inputs, each group with its own
  scale and minimum (``torch._weight_int4pack_mm_for_cpu``). This is exactly
  GGUF's Q4_1 block: a file's Q4_1 weights come back on the same grid
  (tested against the file's raw blocks). A matrix tied to an embedding (the
  vocabulary head, stored 8-bit in such files) is kept in float16 (in int8 it
  cost SmolLM2 1.5 points of greedy agreement), and one whose inputs are not
  a multiple of 32 (or outputs not a multiple of 16) in int8; int8 needs
  inputs in multiples of 16 and leaves other layers in float32, as float16
  does a layer with magnitudes beyond 65504. A warning names every layer kept
  in another form than the one asked (the tied head's float16 aside).

Every form but float32 also keeps embedding tables in float16
(:class:`Float16Embedding`): rows are looked up, not multiplied, so this
saves memory (57 MB of SmolLM2's 113 MB table), not time.

Every packed layer is an op ``torch.compile`` captures (the compiled decode
step of :mod:`attnkit.models.generation` runs on any form). The int8 and
int4 kernels take bfloat16 activations: their float32 path measured 4-25x
slower on this project's CPU (BENCHMARKS.md), so those layers round their
input to bfloat16 and return float32. Given many rows at once (a prompt),
where bfloat16 arithmetic is native, the int8 and int4 layers instead widen
their weight to bfloat16 for that call and run one bfloat16 matrix product
(oneDNN): from 64 rows (int8) or 256 (int4, whose unpacking costs more) this
measured faster than their kernels, 2.3-2.8x at 4,000 rows (a 4,000-token
prompt: 1.4-1.5x faster prefill end to end; BENCHMARKS.md, round seven). The
weight is rounded to bfloat16 on the way (relative error 2^-9, the size of
the input's own rounding). float16 and int4 meet the accuracy bar on SmolLM2
(tests/modules/test_quantize.py: >= 97% greedy agreement, perplexity within
3%); int8 keeps perplexity (within 0.4%) but agrees on 96.1% of greedy
choices: one scale per row is coarser than the file's 4-bit groups. On
other texts int4 agrees on 96.7-98.8% and int8 on 93.4-96.2% (BENCHMARKS.md,
round ten).

Refused, by name: an unknown form, a form this CPU's PyTorch cannot run, a
model (or part of one) quantized twice, a model off the CPU or none of whose
layers fits the form, and a quantized model asked to train, to differentiate
through its packed weights, to move off the CPU or to leave float32 (attnkit's
decoders and MiniLM refuse before any module converts, leaving the model as it
was; in another model each packed layer refuses as it is reached). A
float16 layer (fbgemm's opaque matrix, also int4's head) cannot be saved,
loaded or copied: quantize a copy of the float32 model instead.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnkit._cpu import has_fast_bfloat16

WEIGHT_FORMS = ("float32", "float16", "int8", "int4")
GROUP = 32  # inputs per int4 group: GGUF's Q4_1 block


def available_forms() -> tuple[str, ...]:
    """The weight forms this machine's PyTorch can run (float16 needs the fbgemm engine: x86 CPUs)."""
    if "fbgemm" in torch.backends.quantized.supported_engines:
        return WEIGHT_FORMS
    return ("float32", "int8")  # float16, and int4's float16 head, need fbgemm


def default_form(accurate: Sequence[str] = WEIGHT_FORMS) -> str:
    """The fastest of the ``accurate`` forms on this CPU (BENCHMARKS.md has the measurements).

    ``accurate``: the forms measured to meet the accuracy bar on the model at
    hand (a model class's ``accurate_forms``). Fastest first: int4 where
    bfloat16 arithmetic is native (its kernel computes in bfloat16), float16
    where fbgemm runs it, then int8, then float32.
    """
    order = ("int4", "float16", "int8") if has_fast_bfloat16() else ("float16", "int8", "int4")
    here = available_forms()
    return next((form for form in order if form in accurate and form in here), "float32")


def resolve_form(weights: str, accurate: Sequence[str]) -> str:
    """``weights`` itself, or for "auto" the :func:`default_form` of the ``accurate`` forms."""
    return default_form(accurate) if weights == "auto" else weights


def weight_form(model: nn.Module) -> str:
    """The form a model's linear layers are in ("float32" when none was swapped)."""
    return str(getattr(model, "weight_form", "float32"))


def quantize_rows(x: Tensor, scale_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """int8 codes (..., D) and a scale (...) in ``scale_dtype`` with ``codes * scale`` ~ x (..., D).

    The scale is each row's largest magnitude / 127 (at least float32's smallest
    normal, so an all-zero row keeps codes 0), rounded to ``scale_dtype`` before
    the codes are taken, so ``codes * scale`` is exactly what is read. The int8
    weight form and the int8 KV cache (:mod:`.int8_cache`) both round this way.
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
    dense_rows: int | None = None  # from this many rows on, F.linear over dense_weight() (None: never)
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
        if self.dense_rows is not None and rows.shape[0] >= self.dense_rows:
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
        _refuse_conversion(self.form, fn)
        return self


def _refuse_conversion(form: str, fn: Callable[[Tensor], Tensor]) -> None:
    """Raise unless ``fn`` (what ``.to()``, ``.half()``, ``.cuda()`` apply) keeps float32 on the CPU."""
    probe = fn(torch.zeros((), dtype=torch.float32))  # what the conversion does to a float32 tensor
    if probe.device.type != "cpu":
        raise ValueError(f"a layer with {form} weights runs PyTorch's CPU kernels and cannot move to "
                         f"{probe.device}; load the model with weights='float32' to run it there")
    if probe.dtype != torch.float32:
        raise ValueError(f"a model with {form} weights computes in float32 and cannot be converted to "
                         f"{probe.dtype}; load it with weights='float32' for another dtype")


def check_conversion(model: nn.Module, fn: Callable[[Tensor], Tensor]) -> None:
    """Raise before anything converts if ``fn`` would have to change a packed layer of ``model``.

    A model's ``_apply`` calls this first: ``nn.Module._apply`` converts
    children in order, so a packed layer refusing on its own would leave the
    modules before it (the embedding, the first norm) already converted.
    """
    packed = next((m for m in model.modules() if isinstance(m, PackedLinear)), None)
    if packed is not None:
        _refuse_conversion(packed.form, fn)


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

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, float16"


def _float16_table(module: nn.Module, _: str) -> nn.Module | None:
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
    """The codes (in, out) uint8 in 0..15 of ``torch._convert_weight_to_int4pack_for_cpu``'s AVX512 layout.

    The outputs go in blocks of 64; per block and input, 32 bytes whose byte j
    holds output j (low nibble) and output j + 32 (high). A last block of 16,
    32 or 48 outputs holds pairs: byte j has outputs 2j and 2j + 1. (Other CPU
    builds lay them out otherwise: :class:`Int4Linear` relies on it only
    where :func:`reads_int4_tiles`.)
    """
    full = out_features // 64 * 64
    flat = packed.reshape(-1)  # (N * K / 2,) bytes in the kernel's order
    blocks = flat[: full * in_features // 2].view(full // 64, in_features, 32)  # (N/64, K, 32)
    blocks = torch.stack([blocks & 15, blocks >> 4], dim=2)  # (N/64, K, 2, 32): outputs j, j + 32
    blocks = blocks.permute(1, 0, 2, 3).reshape(in_features, full)  # (K, N/64, 2, 32) -> (K, full)
    if full == out_features:
        return blocks
    rest = flat[full * in_features // 2 :].view(in_features, (out_features - full) // 2)  # (K, r/2)
    rest = torch.stack([rest & 15, rest >> 4], dim=2).reshape(in_features, out_features - full)  # (K, r)
    return torch.cat([blocks, rest], dim=1)  # (K, N)


def int4_fits(out_features: int, in_features: int) -> bool:
    """Whether the int4 kernel's tiles fit a layer: inputs in groups of 32, outputs in multiples of 16."""
    return in_features % GROUP == 0 and out_features % 16 == 0


def _refuse_training(module: nn.Module, _: object) -> None:
    if module.training and torch.is_grad_enabled():
        raise ValueError(f"a model with {weight_form(module)} weights cannot train: its weights are packed for "
                         "inference (no gradients); load it with weights='float32' to train")


def _tied_to_embedding(model: nn.Module) -> set[int]:
    """The storage pointers of every embedding table in ``model`` (a head tied to one shares it)."""
    return {m.weight.untyped_storage().data_ptr() for m in model.modules() if isinstance(m, nn.Embedding)}


Made = tuple[nn.Module, str | None]  # a layer to put in place, and why it is not in the form asked (None: it is)


def _float16(linear: nn.Linear) -> Made:
    """float16, or the float32 layer as it is where float16 cannot hold its weights."""
    if not fits_float16(linear.weight):
        return linear, "weights beyond float16's range, +-65504"
    return Float16Linear(linear.weight, linear.bias), None


def _int8(linear: nn.Linear) -> Made:
    """int8, or the float32 layer as it is where its inputs are not a multiple of 16 (the kernel's)."""
    if linear.in_features % 16:
        return linear, "inputs not a multiple of 16, which int8's kernel needs"
    return Int8Linear(linear.weight, linear.bias), None


Grids = Mapping[str, tuple[Tensor, Tensor, Tensor]]  # module name -> (codes, scale, minimum) of its weight


def _int4_with_float16_head(model: nn.Module, grids: Grids) -> Callable[[nn.Linear, str], Made]:
    """int4 (from ``grids`` where given); float16 for a head tied to an embedding (by design: not reported);
    int8 (or float32) where the sizes do not fit int4's tiles."""
    tied = _tied_to_embedding(model)

    def make(linear: nn.Linear, name: str) -> Made:
        if name in grids:
            return Int4Linear(linear.weight, linear.bias, grid=grids[name]), None
        if linear.weight.untyped_storage().data_ptr() in tied:
            return _float16(linear)
        if not int4_fits(linear.out_features, linear.in_features):
            layer, why = _int8(linear)
            tiles = "sizes outside int4's tiles (inputs in groups of 32, outputs in multiples of 16)"
            return layer, tiles if why is None else f"{tiles}; {why}"
        return Int4Linear(linear.weight, linear.bias), None
    return make


def _check_grid_names(model: nn.Module, grids: Grids) -> None:
    """Every grid must name a linear layer of ``model`` (a misspelt name would leave its layer unread)."""
    linears = {name for name, module in model.named_modules() if isinstance(module, nn.Linear)}
    unknown = sorted(set(grids) - linears)
    if unknown:
        raise ValueError(f"grids {unknown[:3]} name no linear layer of this model (layer names, e.g. "
                         f"{sorted(linears)[:2]})")


Swap = tuple[nn.Module, str, str, Made]  # parent, attribute, qualified name, (replacement, why)


def _planned(module: nn.Module, make: Callable[[nn.Module, str], Made | None], prefix: str = "") -> list[Swap]:
    """Each module below ``module`` that ``make(it, its qualified name)`` replaces (where ``make`` gives None,
    what is inside it), with its replacement built: nothing is swapped yet, so an error leaves the model whole."""
    planned: list[Swap] = []
    for name, child in module.named_children():
        made = make(child, prefix + name)
        if made is not None:
            planned.append((module, name, prefix + name, made))
        else:
            planned += _planned(child, make, prefix + name + ".")
    return planned


def _linears(make: Callable[[nn.Linear, str], Made]) -> Callable[[nn.Module, str], Made | None]:
    """``make`` for ``nn.Linear`` modules, None (look inside) for the others."""
    return lambda module, name: make(module, name) if isinstance(module, nn.Linear) else None


def _table(module: nn.Module, name: str) -> Made | None:
    table = _float16_table(module, name)
    return None if table is None else (table, None)


def _report_kept(planned: list[Swap], weights: str) -> None:
    """Refuse a model none of whose linear layers takes ``weights``; warn, naming them, where some keep another
    form (never a silent fallback)."""
    kept = [(name, layer, why) for _, _, name, (layer, why) in planned if why is not None]
    if not kept:
        return
    listed = "; ".join(f"{name} ({getattr(layer, 'form', 'float32')}: {why})" for name, layer, why in kept[:3])
    more = f"; and {len(kept) - 3} more" if len(kept) > 3 else ""
    if len(kept) == len(planned):
        raise ValueError(f"none of the model's {len(planned)} linear layers can take {weights} weights: {listed}{more}")
    warnings.warn(f"quantize(model, {weights!r}): {len(kept)} of {len(planned)} linear layers keep another form: "
                  f"{listed}{more}", stacklevel=3)


def _check(model: nn.Module, weights: str, grids: Grids) -> None:
    """Raise for a form that is unknown or not here, a model (or any part of it) quantized before, a single
    layer, and linear layers not in float32 or not on the CPU."""
    if weights not in WEIGHT_FORMS:
        raise ValueError(f"unknown weight form {weights!r}; known: {', '.join(WEIGHT_FORMS)}")
    if weights not in available_forms():
        raise ValueError(f"weight form {weights!r} needs PyTorch's fbgemm engine (float16 matrices), which this "
                         f"machine's PyTorch "
                         f"lacks (engines: {', '.join(torch.backends.quantized.supported_engines)})")
    if weight_form(model) != "float32":
        raise ValueError(f"this model's weights are already {weight_form(model)}: quantize a float32 model, once")
    packed = [name or "the model" for name, m in model.named_modules() if isinstance(m, PackedLinear)]
    if packed:
        raise ValueError(f"parts of this model are already quantized ({len(packed)} packed layers: {packed[:3]}): "
                         "quantize a float32 model, once")
    if isinstance(model, nn.Linear):
        raise ValueError("quantize() swaps the nn.Linear layers inside a model, and was given a single nn.Linear: "
                         "wrap it (nn.Sequential(layer)) or build a packed layer from it (Int8Linear(layer.weight, "
                         "layer.bias), Int4Linear, Float16Linear)")
    floats = {p.dtype for m in model.modules() if isinstance(m, nn.Linear) for p in m.parameters()}
    if floats - {torch.float32}:
        raise ValueError(f"quantize() takes a float32 model; its linear layers are {sorted(map(str, floats))}")
    read = [p for name, m in model.named_modules() if isinstance(m, nn.Linear) and name not in grids
            for p in m.parameters()]  # a layer with a grid is built from it: its weight may be an unread placeholder
    devices = {str(p.device) for p in read} - {"cpu"}
    if devices:
        raise ValueError(f"quantize() packs weights for PyTorch's CPU kernels, and this model's linear layers are "
                         f"on {sorted(devices)}: quantize it on the CPU (model.cpu()), or run it there in float32")


def quantize(model: nn.Module, weights: str, *, grids: Grids | None = None) -> nn.Module:
    """Swap every ``nn.Linear`` of ``model`` for ``weights``' form, in place; the model is returned in eval mode.

    Works on attnkit's decoders and MiniLM, whose attention layers check their
    input against an activation dtype, never a weight's (modules that read a
    linear layer's ``.weight`` themselves, such as the textbook's, cannot run
    packed). Layers a form cannot hold keep another (int8 needs inputs in
    multiples of 16, int4 its tiles, float16 magnitudes up to 65504): a
    warning names them, and a model none of whose layers fits is refused. ``grids``
    (int4 only): for layers named in it, their 4-bit grid as read from a file
    (:func:`attnkit.models.gguf.q4_1_grid`), used instead of their weight.
    """
    if grids and weights != "int4":
        raise ValueError(f"grids are 4-bit weights: they go with weights='int4', not {weights!r}")
    if weights == "float32" and weight_form(model) == "float32":
        return model  # nothing to swap, whatever the model's dtype (a bfloat16 model stays as it is)
    _check(model, weights, grids or {})
    make: Callable[[nn.Linear, str], Made] = {
        "float16": lambda linear, _: _float16(linear),
        "int8": lambda linear, _: _int8(linear),
    }.get(weights) or _int4_with_float16_head(model, grids or {})
    _check_grid_names(model, grids or {})
    linears = _planned(model, _linears(make))  # every packed layer built before anything is swapped
    if not linears:
        raise ValueError(f"this model has no nn.Linear layer to take {weights} weights")
    _report_kept(linears, weights)
    for parent, name, _, (layer, _) in linears + _planned(model, _table):
        setattr(parent, name, layer)
    model.weight_form = weights  # type: ignore[assignment]
    model.register_forward_pre_hook(_refuse_training)
    return model.eval()
