"""bf16 matrix products on the CPU from the row count where they beat fp32, measured once at start-up.

A block's linear layers (:data:`BLOCK_LINEARS`) and the output layer take and give fp32; the embedding, the norms,
attention and the KV cache stay fp32, and only the MLP's hidden activation stays bf16 between its two products."""

from __future__ import annotations

import copy
import functools
import time
from dataclasses import dataclass
from functools import partial
from types import MethodType

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from shared.llama import LlamaMLP
from shared.model import MLP, DecoderModel

NEVER = 2**62  # a row count no call reaches: bf16 never used
# bf16 products run on row counts rounded up to this multiple, bounding the kernels oneDNN JIT-compiles (one per shape)
ROW_BUCKET = 16


class Bf16MatmulLinear(nn.Module):
    """A linear layer, fp32 in and out: a call of at least ``min_rows`` rows (tokens) multiplies in bf16 with fp32
    accumulation, a smaller one in exact fp32. Keeps only the weights its calls read (no bf16 copy at :data:`NEVER`)."""

    def __init__(self, linear: nn.Linear, min_rows: int) -> None:
        super().__init__()
        self.in_features, self.out_features, self.min_rows = linear.in_features, linear.out_features, min_rows
        fp32_used, bf16_used = min_rows > 1, min_rows < NEVER
        weight, bias = linear.weight.detach().float(), None if linear.bias is None else linear.bias.detach().float()
        self.weight = nn.Parameter(weight, requires_grad=False) if fp32_used else None
        self.bias = nn.Parameter(bias, requires_grad=False) if fp32_used and bias is not None else None
        # not a buffer: oneDNN's layout is an opaque tensor that cannot be moved, saved or deep-copied
        self.weight_bf16 = onednn_layout(weight.to(torch.bfloat16)) if bf16_used else None
        self.register_buffer("bias_bf16", bias.to(torch.bfloat16) if bf16_used and bias is not None else None)

    def __deepcopy__(self, memo: dict) -> Bf16MatmulLinear:
        """A copy that lays out its own bf16 weights (oneDNN's opaque copy has no storage to copy)."""
        clone = type(self).__new__(type(self))
        memo[id(self)] = clone
        clone.__dict__.update({name: copy.deepcopy(value, memo) for name, value in self.__dict__.items() if name != "weight_bf16"})
        if self.weight_bf16 is not None:
            plain = self.weight_bf16.to_dense() if self.weight_bf16.is_mkldnn else self.weight_bf16
            clone.weight_bf16 = onednn_layout(plain.clone())
        else:
            clone.weight_bf16 = None
        return clone

    def forward(self, x: Tensor) -> Tensor:
        # EXERCISE ch05.3 BEGIN "bf16 from min_rows rows, exact fp32 below"
        if x.numel() >= self.min_rows * self.in_features:
            return _bf16_linear(x, self.weight_bf16, self.bias_bf16)
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, bf16 from {self.min_rows} rows"


class Bf16MLP(nn.Module):
    """A GPT block's MLP whose large calls stay bf16 from the first product to the second, tanh-GELU fused into the
    first product's epilogue (a oneDNN post-op). Calls below ``min_rows`` take :class:`~shared.model.MLP`'s fp32 path."""

    def __init__(self, mlp: MLP, min_rows: int) -> None:
        super().__init__()
        self.c_fc, self.c_proj = Bf16MatmulLinear(mlp.c_fc, min_rows), Bf16MatmulLinear(mlp.c_proj, min_rows)

    def forward(self, x: Tensor) -> Tensor:
        if x.numel() < self.c_fc.min_rows * self.c_fc.in_features:
            return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))
        hidden = linear_gelu_bf16(bf16_rows(x), self.c_fc.weight_bf16, self.c_fc.bias_bf16)
        return _unpadded(linear_bf16(hidden, self.c_proj.weight_bf16, self.c_proj.bias_bf16), x)


class Bf16GatedMLP(nn.Module):
    """A Llama block's gated MLP, ``down(silu(gate) * up)``, whose large calls stay bf16 from the gate/up product to the
    down product (SiLU on the gate's half only). Calls below ``min_rows`` take :class:`~shared.llama.LlamaMLP`'s path."""

    def __init__(self, mlp: LlamaMLP, min_rows: int) -> None:
        super().__init__()
        self.gate_up_proj = Bf16MatmulLinear(mlp.gate_up_proj, min_rows)
        self.down_proj = Bf16MatmulLinear(mlp.down_proj, min_rows)

    def forward(self, x: Tensor) -> Tensor:
        if x.numel() < self.gate_up_proj.min_rows * self.gate_up_proj.in_features:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
            return self.down_proj(F.silu(gate) * up)
        gate, up = linear_bf16(bf16_rows(x), self.gate_up_proj.weight_bf16, self.gate_up_proj.bias_bf16).chunk(2, dim=-1)
        hidden = F.silu(gate) * up
        return _unpadded(linear_bf16(hidden, self.down_proj.weight_bf16, self.down_proj.bias_bf16), x)


@dataclass(frozen=True)
class BlockLinears:
    """Where one family's transformer block keeps the linear layers that multiply in bf16, as attribute paths inside a
    block (``block.get_submodule(path)``)."""
    attention: tuple[str, ...]  # the projections into and out of attention: each a Bf16MatmulLinear
    mlp: str  # the MLP, replaced whole by ``bf16_mlp``
    bf16_mlp: type[nn.Module]  # built as ``bf16_mlp(mlp, min_rows)``
    widest: str  # the layer the crossover is measured on: the MLP's first product, the widest
    final_norm: str  # the model's norm before its output layer (a model attribute)


BLOCK_LINEARS: dict[str, BlockLinears] = {
    "gpt2": BlockLinears(attention=("attn.c_attn", "attn.c_proj"), mlp="mlp", bf16_mlp=Bf16MLP, widest="mlp.c_fc",
                         final_norm="ln_f"),
    "llama": BlockLinears(attention=("self_attn.qkv_proj", "self_attn.o_proj"), mlp="mlp", bf16_mlp=Bf16GatedMLP,
                          widest="mlp.gate_up_proj", final_norm="norm"),
}


def _onednn_linear():
    """oneDNN's product with a fused element-wise op (``mkldnn._linear_pointwise``: private, so looked up), or None."""
    return getattr(torch.ops.mkldnn, "_linear_pointwise", None) if torch.backends.mkldnn.is_available() else None


@functools.cache
def onednn_takes_bf16() -> bool:
    """Whether oneDNN runs a bf16 product on this CPU, plain and fused: some refuse below AVX-512 (or under a
    lower ``ONEDNN_MAX_CPU_ISA``) only when the product runs, so one tiny product runs first, once per process."""
    fused, reorder = _onednn_linear(), getattr(torch.ops.mkldnn, "_reorder_linear_weight", None)
    if fused is None or reorder is None:
        return False
    x, weight = torch.zeros(1, 16, dtype=torch.bfloat16), torch.zeros(16, 16, dtype=torch.bfloat16)
    try:
        fused(x, reorder(weight), None, "none", [], "")
        fused(x, weight, None, "gelu", [], "tanh")
    except RuntimeError:
        return False
    return True


def onednn_layout(weight: Tensor) -> Tensor:
    """``weight`` (out, in), bf16, laid out once in oneDNN's blocked layout so no product reorders it (same result to the
    bit); the plain weight where this torch lacks oneDNN's ops or oneDNN refuses bf16 on this CPU."""
    reorder = getattr(torch.ops.mkldnn, "_reorder_linear_weight", None)
    if _onednn_linear() is None or reorder is None or weight.device.type != "cpu" or not onednn_takes_bf16():
        return weight
    try:
        return reorder(weight)
    except RuntimeError:
        return weight


def linear_bf16(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """``x @ weight.T + bias`` for bf16 ``x`` (R, K) and a weight from :func:`onednn_layout` (or a plain one), in bf16."""
    if weight.is_mkldnn or (torch.compiler.is_compiling() and _takes_onednn_product(x)):  # a traced weight is never is_mkldnn
        return onednn_product(x, weight, bias, "none", "")
    return F.linear(x, weight, bias)


def onednn_product(x: Tensor, weight: Tensor, bias: Tensor | None, post_op: str, algorithm: str) -> Tensor:
    """oneDNN's product (``mkldnn._linear_pointwise``) with ``post_op`` fused; under ``torch.compile``, through
    :func:`compiled_onednn_product`."""
    if torch.compiler.is_compiling():
        return compiled_onednn_product(x, weight, bias, post_op, algorithm)
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, post_op, [], algorithm)


def _takes_onednn_product(x: Tensor) -> bool:
    return x.device.type == "cpu" and _onednn_runs_bf16()


@torch.compiler.assume_constant_result  # read once while tracing: the probe would split a compiled graph
def _onednn_runs_bf16() -> bool:
    return _onednn_linear() is not None and onednn_takes_bf16()


@torch.library.custom_op("serving::onednn_product", mutates_args=())
def compiled_onednn_product(x: Tensor, weight: Tensor, bias: Tensor | None, post_op: str, algorithm: str) -> Tensor:
    """oneDNN's product as one operator that ``torch.compile`` calls and never looks into: Inductor lowers oneDNN's
    products only for weights that are constants of its own graph, and a block's laid-out weight is an input to it."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, post_op, [], algorithm)


@compiled_onednn_product.register_fake
def _compiled_onednn_product_shape(x: Tensor, weight: Tensor, bias: Tensor | None, post_op: str, algorithm: str) -> Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


def linear_gelu_bf16(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """``tanh-GELU(x @ weight.T + bias)`` in bf16, one oneDNN call where this torch has the fused op."""
    if weight.is_mkldnn or _takes_onednn_product(x):
        return onednn_product(x, weight, bias, "gelu", "tanh")
    return F.gelu(F.linear(x, weight, bias), approximate="tanh")


def bf16_crossover_rows(
    linear: nn.Linear, candidates: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64), repeats: int = 30
) -> tuple[int | None, dict[int, tuple[float, float]]]:
    """Where bf16 starts to beat fp32 for this layer's shape (:func:`crossover_from_timings`), and the median of
    ``repeats`` timings per candidate row count, in microseconds: ``{rows: (fp32, bf16)}``."""
    weight = linear.weight.detach().float()
    bias = None if linear.bias is None else linear.bias.detach().float()
    weight16, bias16 = onednn_layout(weight.to(torch.bfloat16)), None if bias is None else bias.to(torch.bfloat16)
    timings: dict[int, tuple[float, float]] = {}
    with torch.no_grad():
        for rows in candidates:
            x = torch.randn(rows, linear.in_features)
            fp32 = _median_us(partial(F.linear, x, weight, bias), repeats)
            bf16 = _median_us(partial(_bf16_linear, x, weight16, bias16), repeats)
            timings[rows] = (fp32, bf16)
    return crossover_from_timings(timings), timings


def crossover_from_timings(timings: dict[int, tuple[float, float]]) -> int | None:
    """The smallest row count from which bf16 (second figure) is faster at every larger measured count (past the
    largest, bf16 only gets better); None when bf16 loses even at the largest count (a CPU that emulates bf16)."""
    # EXERCISE ch05.1 BEGIN "the bf16 crossover: the smallest row count from which bf16 wins at every larger one"
    crossover = None
    for rows in sorted(timings, reverse=True):
        fp32, bf16 = timings[rows]
        if bf16 >= fp32:
            break
        crossover = rows
    return crossover


def _bf16_linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return _unpadded(linear_bf16(bf16_rows(x), weight, bias), x)


def padded_rows(rows: int) -> int:
    """``rows`` rounded up to :data:`ROW_BUCKET`: the row count every bf16 product is called with."""
    return -(-rows // ROW_BUCKET) * ROW_BUCKET


def bf16_rows(x: Tensor) -> Tensor:
    """``x`` (..., K) as bf16 rows (R, K), R its row count rounded up to :data:`ROW_BUCKET`, the rows past its own zero
    (rows never mix in a product, so the padding changes no row of the result; :func:`_unpadded` drops it)."""
    rows = x.numel() // x.shape[-1]
    padded, flat = padded_rows(rows), x.reshape(rows, x.shape[-1])
    if padded == rows:
        return flat.to(torch.bfloat16)
    out = torch.empty(padded, x.shape[-1], dtype=torch.bfloat16, device=x.device)
    out[rows:].zero_()
    out[:rows].copy_(flat)
    return out


def _unpadded(y: Tensor, x: Tensor) -> Tensor:
    """The rows of ``y`` that ``x`` asked for, fp32, in ``x``'s leading shape."""
    rows = x.numel() // x.shape[-1]
    return y[:rows].float().view(*x.shape[:-1], y.shape[-1])


def _median_us(call, repeats: int) -> float:
    call()  # the first call pays oneDNN's one-off setup for this shape
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        samples.append((time.perf_counter() - started) * 1e6)
    return sorted(samples)[len(samples) // 2]


def output_layer(model: DecoderModel) -> nn.Linear:
    """``model``'s output layer as a linear layer: its own, or one that reads the tied embedding's weight (no copy)."""
    weight = model.embedding.weight if getattr(model, "lm_head", None) is None else model.lm_head.weight
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    linear.weight = nn.Parameter(weight.detach(), requires_grad=False)
    return linear


def _bf16_head(model: DecoderModel, x: Tensor) -> Tensor:
    """:meth:`DecoderModel.head` through ``model.bf16_output_layer``: the final norm, then the output layer."""
    return model.bf16_output_layer(getattr(model, BLOCK_LINEARS[model.config.family].final_norm)(x))


def with_bf16_matmuls(model: DecoderModel, min_rows: int | None = None) -> DecoderModel:
    """``model`` (changed in place) with its blocks' linear layers (:data:`BLOCK_LINEARS`) and its output layer
    multiplying in bf16 from ``min_rows`` rows; ``None`` measures it on the widest block layer (:data:`NEVER` where bf16
    never wins). Records ``{"min_rows", "timings_us"}`` as ``model.bf16_tuning``; the embedding stays fp32."""
    linears = BLOCK_LINEARS[model.config.family]
    timings: dict[int, tuple[float, float]] = {}
    if min_rows is None:
        measured, timings = bf16_crossover_rows(model.blocks[0].get_submodule(linears.widest))
        min_rows = measured if measured is not None else NEVER
    for block in model.blocks:
        for path in linears.attention:
            block.set_submodule(path, Bf16MatmulLinear(block.get_submodule(path), min_rows))
        block.set_submodule(linears.mlp, linears.bf16_mlp(block.get_submodule(linears.mlp), min_rows))
    model.bf16_output_layer = Bf16MatmulLinear(output_layer(model), min_rows)
    model.head = MethodType(_bf16_head, model)  # the instance's own: a deep copy binds it to the copy
    model.bf16_tuning = {"min_rows": min_rows, "timings_us": timings}
    return model.eval()
