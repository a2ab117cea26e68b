"""`EngineInfo`: what an engine is, as plain immutable data (built by engine/build/builder.py), and
the request validation that needs nothing else. The banner, /v1/models, /health and the
asyncio side's validation read this, never the engine's live objects."""

from __future__ import annotations

from dataclasses import dataclass

from engine.core.images import PromptImage
from engine.core.sampling_params import ParamError, SamplingParams
from models.spec import VisionSpec


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """What the engine is, as plain data: the banner, /v1/models, /health and request
    validation on the asyncio side read this, never the engine's live objects."""

    model_path: str
    architecture: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    dtype: str
    dtype_reason: str  # why this dtype (explicit, or what `auto` measured and read)
    device: str
    packed_weight_bytes: int
    num_blocks: int
    block_size: int
    kv_block_bytes: int
    prefix_caching: bool
    kv_bytes_per_token: int  # target model only
    kv_bytes_per_token_unshared: int  # what one KV group per layer would take
    # a token's share at the full context where windowed groups keep only their window (the
    # same as kv_bytes_per_token where they keep every token)
    kv_bytes_per_token_full_context: int
    num_kv_groups: int
    draft_kv_bytes_per_token: int
    attention_backend: str
    device_label: str
    compiled_decode: bool  # the C++ paged-decode op serves CPU decode steps
    compiled_prefill: str | None  # the C++ prefill op's arithmetic where it serves CPU prefill
    cuda_graphs: tuple[int, ...]  # decode batch sizes captured as CUDA graphs (empty: eager)
    kernel_table: str
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    draft_layout: str | None
    draft_source: str  # the head's directory, and whether it was the shipped one
    num_speculative_tokens: int
    draft_sources: tuple[str, ...]  # engine/spec/drafting.py; () when speculation is off
    spec_max_verify_rows: int
    spec_cost: str  # measured verify/draft step costs (adaptive k), "" when not measured
    draft_corpus: str  # corpus drafts' answer corpus: its size and directory; "" without one
    has_host_tier: bool
    pooling: str = "last"  # embedding requests' pooling (engine/runner/pooling.py)
    # the remote store's key namespace for this instance's blocks (engine/kv/identity.py)
    kv_namespace: bytes = b""
    host_block_bytes: int = 0  # one block's bytes across KV groups (a remote store value)
    tensor_parallel_size: int = 1
    architecture_traits: str = ""  # ModelSpec.traits(): sliding windows, experts
    window_kv: str = ""  # where the sliding-window layers' KV lives (engine/kv/window.py)
    kv_cache_bytes: int = 0  # every KV tensor's bytes (the window pool's included)
    # a vision-language model's image placeholder id and soft tokens an image (None: text only)
    image_token_id: int | None = None
    tokens_per_image: int = 0
    encoder_cache_bytes: int = 0  # the image encoder cache's bound (engine/runner/encoder.py)
    vision: VisionSpec | None = None  # how its images become soft tokens (None: text only)

    def validate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        images: tuple[PromptImage, ...] = (),
    ) -> None:
        """A prompt, its images and its sampling parameters fit this engine, or ParamError
        says why."""
        field = "input" if params.pooling else "prompt"  # embeddings name their input `input`
        if not prompt_token_ids:
            raise ParamError(field, f"{field} must contain at least one token")
        vocab = self.vocab_size
        self._validate_images(prompt_token_ids, images)
        image_id = self.image_token_id  # may lie past the vocabulary (Gemma 3's does)
        bad = next((t for t in prompt_token_ids if not 0 <= t < vocab and t != image_id), None)
        if bad is not None:
            raise ParamError(field, f"token id {bad} is outside the vocabulary [0, {vocab})")
        if params.pooling:  # prefill only: no output tokens
            self._validate_length(len(prompt_token_ids))
            return
        total = len(prompt_token_ids) + params.max_tokens
        if total > self.max_model_len:
            raise ParamError(
                "max_tokens",
                f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                f"requested {total} tokens ({len(prompt_token_ids)} in the messages, "
                f"{params.max_tokens} in the completion). Please reduce the length of the "
                "messages or completion.",
            )
        if -(-total // self.block_size) > self.num_blocks:
            raise ParamError(
                "max_tokens",
                f"{total} tokens need more than the {self.num_blocks * self.block_size} tokens of "
                "KV cache this server has",
            )
        for token_id in params.logit_bias:
            if not 0 <= token_id < vocab:
                raise ParamError("logit_bias", f"token id {token_id} is outside the vocabulary")

    def _validate_images(self, prompt: list[int], images: tuple[PromptImage, ...]) -> None:
        """Each image covers placeholder tokens only, in order, without overlap, and every
        placeholder token belongs to an image (its embedding would otherwise be undefined)."""
        image_id = self.image_token_id
        if images and image_id is None:
            raise ParamError("prompt", "this model takes text only; it cannot read images")
        at = 0
        for k, image in enumerate(images):
            span = prompt[image.offset : image.end]
            if image.offset < at or image.num_tokens <= 0 or image.end > len(prompt):
                raise ParamError("prompt", f"image {k} lies outside the prompt or overlaps another")
            if any(t != image_id for t in span):
                raise ParamError("prompt", f"image {k}'s positions do not hold its placeholder")
            self._validate_geometry(k, image)
            # a two-way image is computed in one step (a causal one may be split)
            if image.two_way and image.num_tokens > self.max_num_batched_tokens:
                raise ParamError(
                    "prompt",
                    f"image {k} takes {image.num_tokens} tokens, more "
                    f"than a step's {self.max_num_batched_tokens}",
                )
            at = image.end
        if image_id is not None and prompt.count(image_id) != sum(i.num_tokens for i in images):
            raise ParamError(
                "prompt", f"token id {image_id} is an image's placeholder; send the image itself"
            )

    def _validate_geometry(self, k: int, image: PromptImage) -> None:
        """The image is what this model's tower reads: a patch grid exactly where the tower
        is dynamic-resolution, its pixels that many patches, the soft tokens the tower makes
        of it, and its attention (two-way or causal) the model's."""
        vision = self.vision
        if vision is None:
            return
        if (image.grid is None) != (vision.spatial_merge == 0):
            why = "has no patch grid" if image.grid is None else "has a patch grid"
            reads = "patches" if vision.spatial_merge else "whole images"
            raise ParamError("prompt", f"image {k} {why}; this model's tower reads {reads}")
        if image.grid is not None:
            t, h, w = image.grid
            m = vision.spatial_merge
            if min(t, h, w) <= 0 or h % m or w % m or image.pixels.shape[0] != t * h * w:
                raise ParamError("prompt", f"image {k}'s patches do not fill its grid {image.grid}")
        made = vision.image_tokens(image.grid)
        if image.num_tokens != made:
            raise ParamError(
                "prompt",
                f"image {k} takes {image.num_tokens} positions; this "
                f"model makes {made} soft tokens of it",
            )
        if image.two_way != vision.two_way:
            raise ParamError(
                "prompt",
                f"image {k}'s attention is not this model's "
                f"({'two-way' if vision.two_way else 'causal'})",
            )

    def _validate_length(self, n: int) -> None:
        if n > self.max_model_len:
            raise ParamError(
                "input",
                f"This model's maximum context length is {self.max_model_len} tokens; an input "
                f"has {n} tokens. Please reduce the length of the input.",
            )
        if -(-n // self.block_size) > self.num_blocks:
            raise ParamError(
                "input",
                f"an input of {n} tokens needs more than the "
                f"{self.num_blocks * self.block_size} tokens of KV cache this server has",
            )
