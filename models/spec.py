"""Model geometry: one `ModelSpec` describes every layer, so the KV pool and the attention backends
can size and plan themselves without knowing the architecture."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class LayerSpec:
    """Geometry of one decoder layer. `kv_group` names the KV-cache group this layer reads and
    writes; layers that share KV across layers point at the same group."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  # an expert's, in a mixture-of-experts layer
    kv_group: int
    num_experts: int = 0  # 0: a dense FFN
    num_experts_per_tok: int = 0
    # values are the key projection's output (Gemma 4's `attention_k_eq_v` full layers): the
    # layer projects no v rows, though it still stores V (normed and unrotated, unlike K)
    k_eq_v: bool = False


@dataclass(frozen=True, slots=True)
class KVGroupSpec:
    """One KV group's block where it is not one K and one V per token per KV head (DeepSeek V4):
    `planes` tensors (2: K and V; 1: keys that are their own values, compressed entries, a
    compressor's rows) of `heads` x `width` values per entry, an entry per `rate` tokens (a block
    of B tokens holds max(1, B // rate) of them); `windowed`: only the sliding window's blocks
    are kept (the rest go back to the pool, engine/kv/window.py)."""

    planes: int
    heads: int
    width: int
    rate: int = 1
    windowed: bool = False
    role: str = "kv"  # what the group holds, for the banner and the bench

    def entries_per_block(self, block_size: int) -> int:
        return max(1, block_size // self.rate)

    def block_values(self, block_size: int) -> int:
        return self.planes * self.heads * self.width * self.entries_per_block(block_size)


@dataclass(frozen=True, slots=True)
class VisionSpec:
    """What a vision-language model's images are to the serving stack: each image becomes
    soft tokens at placeholder positions holding `image_token_id`, written by the processor
    between `begin_token_id` and `end_token_id`: `tokens_per_image` of them (Gemma 3), or, at
    dynamic resolution (`spatial_merge` > 0, Qwen2.5-VL), one per `spatial_merge` x
    `spatial_merge` patches of the image's own patch grid. `two_way`: the soft tokens of one
    image attend to each other in both directions (Gemma 3; Qwen's stay causal). `marker`:
    what the chat template writes for an image, which the processor widens ("begin": the
    begin token, widened into the whole block; "image": the placeholder itself, between the
    begin and end tokens the template wrote, repeated; "wrapped": the placeholder itself,
    widened into begin, the repeated placeholder and end: Gemma 4). `tower_config`: the
    checkpoint's vision config, for the encoder's own builder (models/gemma3_vision.py,
    models/qwen_vision.py, models/gemma4_vision.py)."""

    architecture: str  # "gemma3", "qwen2_5_vl", "qwen3_vl", "gemma4"
    image_token_id: int
    tokens_per_image: int  # 0: each image's own (dynamic resolution)
    begin_token_id: int | None
    end_token_id: int | None
    tower_config: dict = field(default_factory=dict, compare=False)
    spatial_merge: int = 0
    two_way: bool = True
    marker: str = "begin"
    # Gemma 4: the two-way spans hold on the sliding-window layers only (full-context: causal)
    two_way_windowed_only: bool = False

    def image_tokens(self, grid: tuple[int, int, int] | None) -> int:
        """Soft tokens of an image whose patch grid (t, h, w) is `grid` (None: fixed size)."""
        if not self.spatial_merge:
            return self.tokens_per_image
        assert grid is not None, "a dynamic-resolution image has a patch grid"
        return grid[0] * grid[1] * grid[2] // self.spatial_merge**2


@dataclass(frozen=True, slots=True)
class ModelSpec:
    architecture: str
    vocab_size: int
    hidden_size: int
    layers: tuple[LayerSpec, ...]
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    sliding_window: int | None = None
    # layers that attend to the whole context although the model has a window (Gemma 3's
    # global layers, every sixth); the others attend over the last `sliding_window` tokens
    full_attention_layers: tuple[int, ...] = ()
    local_rope_theta: float | None = None  # the windowed layers' rope base, unscaled (Gemma 3)
    partial_rotary_factor: float = 1.0  # rotary on the first head_dim * factor dims (Phi-4)
    # M-RoPE (Qwen2.5-VL): positions have three axes (t, h, w) and the rotary frequencies are
    # split among them in these sections (models/mrope.py); `mrope_interleaved`: Qwen3-VL's
    # h/w frequencies interleaved with t's rather than in contiguous sections
    mrope_section: tuple[int, ...] = ()
    mrope_interleaved: bool = False
    # Gemma: embeddings times sqrt(hidden); RMSNorm on the attention and FFN outputs too;
    # softmax scale query_pre_attn_scalar ** -0.5 rather than head_dim ** -0.5; tanh-capped logits
    embedding_multiplier: float = 1.0
    sandwich_norms: bool = False
    v_norm: bool = False  # Gemma 4: RMSNorm without a weight on the values before they are stored
    attention_scale: float | None = None
    final_logit_softcap: float | None = None
    moe_renormalize: bool = True  # top-k routing weights renormalised to sum to 1
    # the KV groups, where their blocks are not derived from the layers (DeepSeek V4's window,
    # compressor rows and compressed entries); empty: one K/V group per `LayerSpec.kv_group`
    group_specs: tuple[KVGroupSpec, ...] = ()
    vision: VisionSpec | None = None  # a vision-language model's images (None: text only)
    extra: dict = field(default_factory=dict)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def layer_window(self, idx: int) -> int | None:
        """The sliding window layer `idx` attends over (None: the whole context)."""
        return None if idx in self.full_attention_layers else self.sliding_window

    @property
    def has_mixed_windows(self) -> bool:
        return self.sliding_window is not None and bool(self.full_attention_layers)

    def rotary_dim(self, head_dim: int) -> int:
        return int(head_dim * self.partial_rotary_factor)

    @property
    def is_moe(self) -> bool:
        return any(lay.num_experts for lay in self.layers)

    def traits(self) -> str:
        """What the banner's arch line adds beyond layers and sizes: windows and experts."""
        notes = []
        windowed = sum(self.layer_window(i) is not None for i in range(self.num_layers))
        if windowed:
            notes.append(
                f"sliding window {self.sliding_window} on {windowed} of {self.num_layers} layers"
            )
        moe = [lay for lay in self.layers if lay.num_experts]
        if moe:
            notes.append(
                f"{moe[0].num_experts} experts, {moe[0].num_experts_per_tok} a token, in "
                f"{len(moe)} of {self.num_layers} layers"
            )
        return "; ".join(notes)

    @property
    def kv_layouts(self) -> list[KVGroupSpec]:
        """Every KV group's block, in group order."""
        if self.group_specs:
            return list(self.group_specs)
        windowed: dict[int, bool] = {}
        for i, lay in enumerate(self.layers):
            windowed[lay.kv_group] = windowed.get(lay.kv_group, True) and (
                self.layer_window(i) is not None
            )
        return [KVGroupSpec(2, h, d, 1, windowed[g]) for g, (h, d) in enumerate(self.kv_groups)]

    def kv_block_bytes(self, block_size: int, dtype_size: float) -> int:
        """Bytes of one block across every KV group."""
        if not self.group_specs:
            return self.kv_bytes_per_token(dtype_size) * block_size
        return round(sum(g.block_values(block_size) * dtype_size for g in self.group_specs))

    @property
    def kv_groups(self) -> list[tuple[int, int]]:
        """(num_kv_heads, head_dim) per KV group, in group order."""
        if self.group_specs:
            return [(g.heads, g.width) for g in self.group_specs]
        shapes: dict[int, tuple[int, int]] = {}
        for layer in self.layers:
            shape = (layer.num_kv_heads, layer.head_dim)
            if shapes.setdefault(layer.kv_group, shape) != shape:
                raise ValueError(f"layers sharing KV group {layer.kv_group} disagree on shape")
        return [shapes[g] for g in sorted(shapes)]

    def kv_group_owner(self, group: int) -> int:
        """The first layer of a KV group: the one that writes its K/V."""
        return next(i for i, lay in enumerate(self.layers) if lay.kv_group == group)

    @property
    def has_kv_sharing(self) -> bool:
        return not self.group_specs and len(self.kv_groups) < self.num_layers

    @property
    def has_per_layer_heads(self) -> bool:
        return len({(lay.num_heads, lay.num_kv_heads, lay.head_dim) for lay in self.layers}) > 1

    def kv_bytes_per_token(self, dtype_size: float) -> int:
        """Bytes of K and V one token occupies across all KV groups (`dtype_size`: bytes a
        value, 1.125 for int8 rows with their scales)."""
        if self.group_specs:  # amortised: an entry per `rate` tokens
            return round(
                sum(g.planes * g.heads * g.width * dtype_size / g.rate for g in self.group_specs)
            )
        return round(sum(2 * h * d * dtype_size for h, d in self.kv_groups))

    def kv_bytes_per_token_at(self, context: int, dtype_size: float) -> int:
        """Bytes a token takes in a request of `context` tokens where windowed groups keep only
        their window (the window's blocks: up to one block more than the window), amortised
        over the request's tokens."""
        window = self.sliding_window or 0
        total = 0.0
        for g in self.kv_layouts:
            per_token = g.planes * g.heads * g.width * dtype_size / g.rate
            kept = min(context, window) / context if g.windowed and window else 1.0
            total += per_token * kept
        return round(total)

    def kv_bytes_per_token_unshared(self, dtype_size: float) -> int:
        """What every layer holding its own KV would take (the banner's comparison)."""
        return round(sum(2 * lay.num_kv_heads * lay.head_dim * dtype_size for lay in self.layers))

    def flops_per_token(self, include_lm_head: bool = True) -> int:
        """Matmul FLOPs of one token through the weights (attention over context excluded)."""
        total = 0
        for i, lay in enumerate(self.layers):
            q = lay.num_heads * lay.head_dim
            owner = self.kv_group_owner(lay.kv_group) == i
            kv = (1 if lay.k_eq_v else 2) * lay.num_kv_heads * lay.head_dim if owner else 0
            total += 2 * self.hidden_size * (q + kv) + 2 * q * self.hidden_size
            beside = self.extra.get("moe_intermediate_size", 0)  # Gemma 4: experts + dense MLP
            if lay.num_experts and beside:
                width = lay.intermediate_size + beside * lay.num_experts_per_tok
            else:
                width = lay.intermediate_size * (lay.num_experts_per_tok or 1)
            if lay.num_experts:  # a shared expert every token goes through (Laguna)
                width += self.extra.get("shared_expert_intermediate_size", 0)
            total += 2 * 3 * self.hidden_size * width
        if include_lm_head:
            total += 2 * self.hidden_size * self.vocab_size
        return total


def uniform_layers(
    num_layers: int, num_heads: int, num_kv_heads: int, head_dim: int, intermediate_size: int
) -> tuple[LayerSpec, ...]:
    return tuple(
        LayerSpec(num_heads, num_kv_heads, head_dim, intermediate_size, kv_group=i)
        for i in range(num_layers)
    )


def hf_model_spec(
    architecture: str, cfg: dict, layers: list[LayerSpec] | tuple[LayerSpec, ...], **fields: object
) -> ModelSpec:
    """A ModelSpec from an HF text config: the fields every such config names alike (vocabulary,
    hidden size, norm epsilon, BOS id) read here, the architecture's own given as `fields`."""
    return ModelSpec(
        architecture=architecture,
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        layers=tuple(layers),
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        bos_token_id=cfg.get("bos_token_id"),
        **fields,  # type: ignore[arg-type]
    )
