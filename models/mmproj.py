"""llama.cpp's `mmproj` projector files beside a GGUF text model: the image path of a
vision-language model as `convert_hf_to_gguf.py --mmproj` writes it (general.architecture
`clip`, `clip.*` metadata, `v.*` / `mm.*` tensors), read into the project's own encoder.

Served: projector type `gemma3` (Gemma 3's SigLIP tower and its pooling projector) beside a
`gemma3` text GGUF; its tensors map one to one onto `Gemma3ImageEncoder` (models/gemma3_vision.py),
dequantized with the `gguf` package (F32, F16, BF16, Q8_0, ...). The converter's transforms are
undone here: `mm.soft_emb_norm` holds Gemma's `1 + w` (the encoder adds the 1 itself);
`mm.input_projection` is stored as transformers holds it ([tower width, text width], which
llama.cpp's graph transposes), the other matrices as nn.Linear's [out, in]. Every other
projector type is refused at startup with its name.

The image placeholder: llama.cpp feeds image embeddings without placeholder tokens and its
converter drops `<image_soft_token>` from the vocabulary (ggml-org/llama.cpp#12876). A file that
still has the token uses it; one that lacks it uses the vocabulary's first unused entry (GGUF
token type 5, such as the converter's `[PAD...]` rows), inside the embedding's rows and never
read (the soft tokens replace its embedding). The server's tokenizer then reads that entry's text
as one special token, so a client's text holding it is refused like a stray placeholder."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch
from gguf import GGUFReader, VisionProjectorType

from models.checkpoint import to_tensor
from models.gemma3_vision import Gemma3ImageEncoder
from models.gguf_loader import field, float_array, gguf_spec
from models.image_processor import ImageProcessor
from models.loader import is_gguf
from models.spec import ModelSpec, VisionSpec

SERVED_PROJECTORS = (VisionProjectorType.GEMMA3,)
_UNUSED = 5  # GGUF token type of an unused vocabulary entry
_BEGIN, _END, _SOFT = "<start_of_image>", "<end_of_image>", "<image_soft_token>"
# the converter's default pooling for Gemma 3 (it writes the factor only where it differs)
_GEMMA3_SCALE = 4


def _known_projectors() -> list[str]:
    return sorted(
        str(getattr(VisionProjectorType, n)) for n in dir(VisionProjectorType) if n.isupper()
    )


class Mmproj:
    """One projector file: its metadata and tensors."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.reader = GGUFReader(path)
        arch = self.get("general.architecture")
        if arch != "clip":
            raise ValueError(
                f"--mmproj {path}: general.architecture is {arch!r}, not an mmproj file ('clip')"
            )
        if not self.get("clip.has_vision_encoder", False):
            raise ValueError(f"--mmproj {path}: the file holds no vision encoder")
        kind = self.get("clip.vision.projector_type") or self.get("clip.projector_type")
        if kind not in SERVED_PROJECTORS:
            others = [k for k in _known_projectors() if k not in SERVED_PROJECTORS]
            raise ValueError(
                f"--mmproj {path}: projector type {kind!r} is not served; served: "
                f"{list(map(str, SERVED_PROJECTORS))} (Gemma 3). Known to llama.cpp but not "
                f"read here: {', '.join(others)}"
            )
        self.projector = str(kind)

    def get(self, key: str, default: object = None) -> object:
        f = self.reader.fields.get(key)
        return default if f is None else f.contents()

    def vision(self, key: str, default: object = None) -> object:
        value = self.get(f"clip.vision.{key}", default)
        if value is None:
            raise ValueError(f"--mmproj {self.path}: clip.vision.{key} is missing")
        return value

    def tower_config(self) -> dict:
        """The SigLIP tower's geometry in transformers' `vision_config` spelling."""
        return {
            "hidden_size": int(self.vision("embedding_length")),
            "intermediate_size": int(self.vision("feed_forward_length")),
            "num_hidden_layers": int(self.vision("block_count")),
            "num_attention_heads": int(self.vision("attention.head_count")),
            "image_size": int(self.vision("image_size")),
            "patch_size": int(self.vision("patch_size")),
            "layer_norm_eps": float(self.vision("attention.layer_norm_epsilon", 1e-6)),
            # llama.cpp's gemma3 graph: ggml_gelu, the tanh approximation, as SigLIP's
            "hidden_act": "gelu_pytorch_tanh",
        }

    def processor(self) -> ImageProcessor:
        """Resize to the tower's square, rescale by 1/255, normalise by the file's mean and std
        (Gemma 3's processor: bilinear, as transformers' PIL processor resizes)."""
        size = int(self.vision("image_size"))
        mean = tuple(float(x) for x in self.vision("image_mean"))
        std = tuple(float(x) for x in self.vision("image_std"))
        return ImageProcessor(size, size, mean=mean, std=std)  # type: ignore[arg-type]

    def tensors(self) -> Iterator[tuple[str, np.ndarray]]:
        for t in self.reader.tensors:
            yield t.name, float_array(t)


def _encoder_name(name: str) -> str:
    """A Gemma 3 mmproj tensor's name in Gemma3ImageEncoder."""
    tower, projector = "vision_tower.", "multi_modal_projector."
    fixed = {
        "v.patch_embd": tower + "embeddings.patch_embedding",
        "v.position_embd": tower + "embeddings.position_embedding",
        "v.post_ln": tower + "post_layernorm",
        "mm.soft_emb_norm": projector + "mm_soft_emb_norm",
    }
    layer = {
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_out": "self_attn.out_proj",
        "ln1": "layer_norm1",
        "ln2": "layer_norm2",
        "ffn_up": "mlp.fc1",
        "ffn_down": "mlp.fc2",
    }
    if name == "mm.input_projection.weight":
        return projector + "mm_input_projection_weight"
    stem, kind = name.rsplit(".", 1)
    if stem in fixed:
        return f"{fixed[stem]}.{kind}"
    parts = stem.split(".")
    if len(parts) == 4 and parts[:2] == ["v", "blk"] and parts[3] in layer:
        return f"{tower}encoder.layers.{parts[2]}.{layer[parts[3]]}.{kind}"
    raise ValueError(f"unexpected tensor {name} in a gemma3 mmproj file")


def gemma3_encoder_weights(mmproj: Mmproj) -> Iterator[tuple[str, torch.Tensor]]:
    """The file's tensors under Gemma3ImageEncoder's names, float32, the converter's `+ 1` on
    the soft-embedding norm taken back off."""
    for name, array in mmproj.tensors():
        if name == "mm.soft_emb_norm.weight":
            array = array - 1.0
        yield _encoder_name(name), to_tensor(np.ascontiguousarray(array))


def _placeholders(text_path: str, spec: ModelSpec) -> tuple[int, int, int, str]:
    """(begin, end, placeholder ids, how the placeholder was found) from the text GGUF's
    vocabulary."""
    tokens = [str(t) for t in field(text_path, "tokenizer.ggml.tokens") or []]
    types = list(field(text_path, "tokenizer.ggml.token_type") or [1] * len(tokens))
    rows = min(len(tokens), spec.vocab_size)  # ids the embedding holds
    ids = {tok: i for i, tok in enumerate(tokens[:rows])}
    missing = [t for t in (_BEGIN, _END) if t not in ids]
    if missing:
        raise ValueError(
            f"{text_path}: the vocabulary lacks {missing}; Gemma 3's prompt "
            "marks an image with them"
        )
    if _SOFT in ids:
        return ids[_BEGIN], ids[_END], ids[_SOFT], f"{_SOFT} (id {ids[_SOFT]})"
    unused = next((i for i in range(rows) if types[i] == _UNUSED), None)
    if unused is None:
        raise ValueError(
            f"{text_path}: the vocabulary has neither {_SOFT} nor an unused entry to hold an "
            "image's positions"
        )
    why = f"{_SOFT} absent from the GGUF vocabulary: unused entry {tokens[unused]!r} (id {unused})"
    return ids[_BEGIN], ids[_END], unused, why


def mmproj_vision_spec(mmproj_path: str, text_path: str) -> VisionSpec:
    """The image side of a GGUF text model served with an mmproj file, or a ValueError naming
    what does not fit: a text model that is not a GGUF or not Gemma 3, another projector type,
    a projector whose output width is not the text model's."""
    if not is_gguf(text_path):
        raise ValueError(
            f"--mmproj goes with a GGUF text model; {text_path} is not a .gguf file (an HF "
            "vision checkpoint carries its own tower: serve the directory without --mmproj)"
        )
    mmproj = Mmproj(mmproj_path)
    spec = gguf_spec(text_path)
    arch = spec.extra.get("gguf_arch")
    if arch != "gemma3":
        raise ValueError(
            f"--mmproj projector {mmproj.projector!r} serves beside a gemma3 text "
            f"GGUF; {text_path} is {arch!r}"
        )
    width = int(mmproj.vision("projection_dim"))
    proj = next((t for t in mmproj.reader.tensors if t.name == "mm.input_projection.weight"), None)
    if proj is None:
        raise ValueError(f"--mmproj {mmproj_path}: no mm.input_projection.weight tensor")
    if width != spec.hidden_size or int(proj.shape[0]) != spec.hidden_size:
        raise ValueError(
            f"--mmproj {mmproj_path} projects images to width {width} (input projection "
            f"{int(proj.shape[0])}); the text model {text_path} is {spec.hidden_size} wide: "
            "the projector belongs to another model"
        )
    tower = mmproj.tower_config()
    side = tower["image_size"] // tower["patch_size"]
    per_side = side // int(mmproj.get("clip.vision.projector.scale_factor", _GEMMA3_SCALE))
    begin, end, soft, why = _placeholders(text_path, spec)
    return VisionSpec(
        architecture="gemma3",
        image_token_id=soft,
        tokens_per_image=per_side * per_side,
        begin_token_id=begin,
        end_token_id=end,
        tower_config={**tower, "placeholder": why},
    )


def load_mmproj_encoder(
    mmproj_path: str, spec: ModelSpec, dtype: torch.dtype, device: torch.device | str
) -> tuple[torch.nn.Module, ImageProcessor]:
    """The projector file's image encoder in `dtype` on `device`, and its image processor."""
    assert spec.vision is not None
    mmproj = Mmproj(mmproj_path)
    encoder = Gemma3ImageEncoder(spec.vision, spec.hidden_size)
    encoder.load_weights(gemma3_encoder_weights(mmproj))
    return encoder.to(device=device, dtype=dtype).eval(), mmproj.processor()
