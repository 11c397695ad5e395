"""Image towers: open_clip ViTs by architecture name, local Hugging Face CLIP/SigLIP dirs, a tiny CNN.

All of them emit patch tokens ``(B, num_patches, width)`` (not only the pooled vector): an LLM reads
an image as a grid of rows, and the projector maps each patch token to one prompt row.
"""

from __future__ import annotations

import copy
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torchvision import transforms

from encoders.checkpoint import load_state_dict_checked
from encoders.parts import Tower, check_keys
from encoders.registry import register_tower
from encoders.vision_inputs import load_image

#: open_clip model configs that exist only in code (open_clip's own come from its JSON files).
BUILTIN_OPEN_CLIP_CONFIGS: dict[str, dict] = {
    # 32x32 images, 8x8 patches -> 16 tokens of width 64; two blocks of 4 heads. ~0.1M parameters.
    "bridge-tiny-vit": {
        "embed_dim": 64,
        "vision_cfg": {
            "image_size": 32,
            "patch_size": 8,
            "width": 64,
            "layers": 2,
            "head_width": 16,
            "mlp_ratio": 2.0,
        },
    },
}


class _ImageTower(Tower):
    modality = "image"

    def collate(self, processed: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"pixel_values": torch.stack(processed)}

    def output_rows(self, item: Any) -> int:
        return self.num_tokens


def _open_clip_model_cfg(arch: str | None, model_cfg: dict | None) -> dict:
    import open_clip

    if model_cfg is not None:
        if not isinstance(model_cfg, dict) or "vision_cfg" not in model_cfg:
            raise ValueError(
                "open_clip tower: model_cfg must be an open_clip model config dict with 'vision_cfg'"
            )
        return copy.deepcopy(model_cfg)
    if not arch:
        raise ValueError(
            "open_clip tower needs 'arch' (an open_clip model name such as 'ViT-B-32') or 'model_cfg'"
        )
    if arch in BUILTIN_OPEN_CLIP_CONFIGS:
        return copy.deepcopy(BUILTIN_OPEN_CLIP_CONFIGS[arch])
    cfg = open_clip.get_model_config(arch)
    if cfg is None:
        vits = [m for m in open_clip.list_models() if m.startswith("ViT-")]
        raise ValueError(
            f"open_clip tower: unknown arch {arch!r}; built-in: {sorted(BUILTIN_OPEN_CLIP_CONFIGS)}, "
            f"open_clip ViTs include {vits[:12]} ... ({len(open_clip.list_models())} models in all)"
        )
    return cfg


@register_tower("open_clip")
class OpenClipTower(_ImageTower):
    """An open_clip vision transformer (patch tokens) with open_clip's own preprocessing.

    Config keys:
      arch:           open_clip model name ("ViT-B-32", "ViT-L-14", ...) or "bridge-tiny-vit"
      model_cfg:      instead of arch, a full open_clip model config dict ({"embed_dim", "vision_cfg", ...})
      vision_cfg:     dict of overrides merged into the arch's vision_cfg (e.g. {"image_size": 64})
      pretrained:     local checkpoint file (.bin/.pt/.safetensors), a full CLIP state dict (its
                      ``visual.*`` keys are used) or a visual-only one; None = random init
      layer:          None (default): final tokens after ln_post; an int (e.g. -2, LLaVA style):
                      raw tokens of that block (blocks after it are dropped)
      keep_cls:       also emit the class token first (default False)
      preprocess_cfg: overrides of open_clip's PreprocessCfg (mean, std, interpolation, resize_mode)
    Rows per image: (image_size / patch_size)^2 (+1 with keep_cls).
    """

    KEYS = {"arch", "model_cfg", "vision_cfg", "pretrained", "layer", "keep_cls", "preprocess_cfg"}

    def __init__(
        self,
        arch: str | None = None,
        model_cfg: dict | None = None,
        vision_cfg: dict | None = None,
        pretrained: str | None = None,
        layer: int | None = None,
        keep_cls: bool = False,
        preprocess_cfg: dict | None = None,
    ):
        super().__init__()
        import open_clip
        from open_clip.model import _build_vision_tower
        from open_clip.transform import PreprocessCfg, image_transform_v2, merge_preprocess_dict
        from open_clip.transformer import VisionTransformer

        full_cfg = _open_clip_model_cfg(arch, model_cfg)
        full_cfg["vision_cfg"] = {**full_cfg["vision_cfg"], **(vision_cfg or {})}
        self._cfg = {
            "arch": arch,
            "model_cfg": full_cfg,
            "layer": layer,
            "keep_cls": bool(keep_cls),
            "preprocess_cfg": dict(preprocess_cfg or {}),
        }
        visual = _build_vision_tower(
            full_cfg["embed_dim"], full_cfg["vision_cfg"], quick_gelu=bool(full_cfg.get("quick_gelu", False))
        )
        if not isinstance(visual, VisionTransformer):
            raise ValueError(
                f"open_clip tower: {arch or 'model_cfg'} builds a {type(visual).__name__}; patch "
                "tokens are supported for VisionTransformer towers only"
            )
        if pretrained:
            path = Path(pretrained)
            if not path.is_file():
                raise ValueError(f"open_clip tower: pretrained file {path} does not exist")
            state = open_clip.factory.load_state_dict(str(path))
            if any(k.startswith("visual.") for k in state):
                state = {k[len("visual.") :]: v for k, v in state.items() if k.startswith("visual.")}
            load_state_dict_checked(visual, state, source=str(path))
        depth = len(visual.transformer.resblocks)
        index = depth - 1 if layer is None else (layer if layer >= 0 else depth + layer)
        if not 0 <= index < depth:
            raise ValueError(f"open_clip tower: layer {layer} is out of range for {depth} blocks")
        self._index, self._normalize = index, layer is None
        visual.prune_intermediate_layers([index], prune_norm=layer is not None, prune_head=True)
        self.visual = visual
        self.out_dim = int(visual.transformer.width)
        grid = visual.grid_size
        self.num_tokens = int(grid[0] * grid[1]) + int(bool(keep_cls))
        pp = merge_preprocess_dict(asdict(PreprocessCfg()), full_cfg.get("preprocess_cfg", {}))
        pp["size"] = visual.image_size
        pp = merge_preprocess_dict(pp, self._cfg["preprocess_cfg"])
        self.transform = image_transform_v2(PreprocessCfg(**pp), is_train=False)

    @classmethod
    def from_config(cls, cfg: dict) -> OpenClipTower:
        check_keys(cfg, cls.KEYS, "tower 'open_clip'")
        return cls(**cfg)

    def export_config(self) -> dict:
        cfg = copy.deepcopy(self._cfg)
        return {
            "name": "open_clip",
            "arch": cfg["arch"],
            "model_cfg": cfg["model_cfg"],
            "pretrained": None,
            "layer": cfg["layer"],
            "keep_cls": cfg["keep_cls"],
            "preprocess_cfg": cfg["preprocess_cfg"],
        }

    def preprocess(self, item: Any) -> torch.Tensor:
        return self.transform(load_image(item))

    def forward(self, batch: dict) -> tuple[torch.Tensor, None]:
        out = self.visual.forward_intermediates(
            batch["pixel_values"],
            indices=[self._index],
            stop_early=True,
            normalize_intermediates=self._normalize,
            intermediates_only=True,
            output_fmt="NLC",
            output_extra_tokens=self._cfg["keep_cls"],
        )
        tokens = out["image_intermediates"][0]
        if self._cfg["keep_cls"]:
            prefix = out["image_intermediates_prefix"][0]
            if self._normalize:
                prefix = self.visual.ln_post(prefix)
            tokens = torch.cat([prefix, tokens], dim=1)
        return tokens, None


_HF_VISION = {
    # model_type -> (vision config class, vision model class, has a class token, default mean/std, crop)
    "clip": (
        "CLIPVisionConfig",
        "CLIPVisionModel",
        True,
        ((0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)),
        True,
    ),
    "siglip": ("SiglipVisionConfig", "SiglipVisionModel", False, ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5)), False),
}


def _hf_family(model_type: str) -> str:
    family = model_type.replace("_vision_model", "")
    if family not in _HF_VISION:
        raise ValueError(
            f"hf_vision tower: model_type {model_type!r} is not supported; "
            f"use a CLIP or SigLIP directory (model_type clip, clip_vision_model, siglip, "
            f"siglip_vision_model)"
        )
    return family


@register_tower("hf_vision")
class HFVisionTower(_ImageTower):
    """A local Hugging Face CLIP or SigLIP vision model directory (full model or vision-only).

    Config keys:
      path:       local directory (config.json + weights); never downloads
      layer:      hidden-state index to read (-1 default = last_hidden_state; -2 = penultimate, LLaVA style)
      keep_cls:   keep CLIP's class token (default False; SigLIP has none)
      hf_config:  (written by save) the vision config dict, to rebuild without ``path``
      image_mean, image_std, crop: (written by save) preprocessing, read from preprocessor_config.json
    Rows per image: (image_size / patch_size)^2 (+1 for CLIP with keep_cls).
    """

    KEYS = {"path", "layer", "keep_cls", "hf_config", "image_mean", "image_std", "crop"}

    def __init__(
        self,
        path: str | None = None,
        layer: int = -1,
        keep_cls: bool = False,
        hf_config: dict | None = None,
        image_mean: list | None = None,
        image_std: list | None = None,
        crop: bool | None = None,
    ):
        super().__init__()
        import transformers

        if path is None and hf_config is None:
            raise ValueError("hf_vision tower needs 'path' (a local CLIP/SigLIP model directory)")
        if path is not None:
            directory = Path(path)
            if not (directory / "config.json").is_file():
                raise ValueError(f"hf_vision tower: {directory} is not a model directory (no config.json)")
            raw = json.loads((directory / "config.json").read_text())
            family = _hf_family(raw.get("model_type", "?"))
            config_cls_name, model_cls_name, _, (mean, std), default_crop = _HF_VISION[family]
            model_cls = getattr(transformers, model_cls_name)
            model = model_cls.from_pretrained(str(directory), local_files_only=True)
            pp_file = directory / "preprocessor_config.json"
            if pp_file.is_file():
                pp = json.loads(pp_file.read_text())
                mean, std = pp.get("image_mean", mean), pp.get("image_std", std)
        else:
            family = _hf_family(hf_config.get("model_type", "?"))
            config_cls_name, model_cls_name, _, (mean, std), default_crop = _HF_VISION[family]
            config = getattr(transformers, config_cls_name).from_dict(copy.deepcopy(hf_config))
            model = getattr(transformers, model_cls_name)(config)
        self.model = model
        self.family = family
        vcfg = model.config
        self.has_cls = _HF_VISION[family][2]
        self.keep_cls = bool(keep_cls) and self.has_cls
        self.layer = int(layer)
        n_hidden = vcfg.num_hidden_layers + 1
        if not -n_hidden <= self.layer < n_hidden:
            raise ValueError(
                f"hf_vision tower: layer {layer} out of range for {vcfg.num_hidden_layers} layers"
            )
        self.out_dim = int(vcfg.hidden_size)
        self.image_size = int(vcfg.image_size)
        self.num_tokens = (self.image_size // int(vcfg.patch_size)) ** 2 + int(self.keep_cls)
        self.image_mean = list(image_mean or mean)
        self.image_std = list(image_std or std)
        self.crop = default_crop if crop is None else bool(crop)
        size = self.image_size if self.crop else (self.image_size, self.image_size)
        steps: list[Any] = [transforms.Resize(size, interpolation=transforms.InterpolationMode.BICUBIC)]
        if self.crop:
            steps.append(transforms.CenterCrop(self.image_size))
        steps += [transforms.ToTensor(), transforms.Normalize(self.image_mean, self.image_std)]
        self.transform = transforms.Compose(steps)

    @classmethod
    def from_config(cls, cfg: dict) -> HFVisionTower:
        check_keys(cfg, cls.KEYS, "tower 'hf_vision'")
        return cls(**cfg)

    def export_config(self) -> dict:
        return {
            "name": "hf_vision",
            "path": None,
            "layer": self.layer,
            "keep_cls": self.keep_cls,
            "hf_config": self.model.config.to_dict(),
            "image_mean": self.image_mean,
            "image_std": self.image_std,
            "crop": self.crop,
        }

    def preprocess(self, item: Any) -> torch.Tensor:
        return self.transform(load_image(item))

    def forward(self, batch: dict) -> tuple[torch.Tensor, None]:
        want_hidden = self.layer != -1
        out = self.model(pixel_values=batch["pixel_values"], output_hidden_states=want_hidden)
        tokens = out.hidden_states[self.layer] if want_hidden else out.last_hidden_state
        if self.has_cls and not self.keep_cls:
            tokens = tokens[:, 1:]
        return tokens, None


@register_tower("conv")
class ConvTower(_ImageTower):
    """A tiny strided CNN: the cheapest image tower, for demos that must train in seconds.

    Config keys: image_size (32), channels ([32, 64]: one stride-2 conv stage each), mean/std (0.5).
    Rows per image: (image_size / 2^len(channels))^2, one per cell of the final feature map.
    """

    KEYS = {"image_size", "channels", "mean", "std"}

    def __init__(
        self,
        image_size: int = 32,
        channels: list[int] | tuple[int, ...] = (32, 64),
        mean: float = 0.5,
        std: float = 0.5,
    ):
        super().__init__()
        if not isinstance(channels, (list, tuple)) or not all(
            isinstance(c, int) and not isinstance(c, bool) and 1 <= c <= 65536 for c in channels
        ):
            raise ValueError(f"conv tower: channels must be a list of ints in [1, 65536], got {channels!r}")
        if not isinstance(image_size, int) or isinstance(image_size, bool) or not 1 <= image_size <= 8192:
            raise ValueError(f"conv tower: image_size must be an int in [1, 8192], got {image_size!r}")
        channels = [int(c) for c in channels]
        if not channels or image_size % (2 ** len(channels)):
            raise ValueError(
                f"conv tower: image_size {image_size} must be divisible by 2^len(channels) "
                f"= {2 ** len(channels)}"
            )
        self._cfg = {"image_size": int(image_size), "channels": channels, "mean": mean, "std": std}
        layers: list[nn.Module] = []
        prev = 3
        for c in channels:
            layers += [nn.Conv2d(prev, c, 3, stride=2, padding=1), nn.GroupNorm(1, c), nn.GELU()]
            prev = c
        self.net = nn.Sequential(*layers)
        grid = image_size // 2 ** len(channels)
        self.pos = nn.Parameter(torch.zeros(grid * grid, prev))
        self.out_dim, self.num_tokens = prev, grid * grid
        self.transform = transforms.Compose(
            [
                transforms.Resize((image_size, image_size)),
                transforms.ToTensor(),
                transforms.Normalize([mean] * 3, [std] * 3),
            ]
        )

    @classmethod
    def from_config(cls, cfg: dict) -> ConvTower:
        check_keys(cfg, cls.KEYS, "tower 'conv'")
        return cls(**cfg)

    def export_config(self) -> dict:
        return {"name": "conv", **copy.deepcopy(self._cfg)}

    def preprocess(self, item: Any) -> torch.Tensor:
        return self.transform(load_image(item))

    def forward(self, batch: dict) -> tuple[torch.Tensor, None]:
        x = self.net(batch["pixel_values"])
        return x.flatten(2).transpose(1, 2) + self.pos, None
