"""The names of the encoder parts built into `encoders/`, as plain data.

`bridge defaults` lists the registered parts; importing the registry to read them loads torch,
torchvision and every built-in tower (seconds), so the command reads this table instead when no
recipe adds parts of its own. tests/test_cli_fast.py checks it against the real registry.
"""

from __future__ import annotations

BUILTIN_PARTS: dict[str, tuple[str, ...]] = {
    "towers": ("conformer", "conv", "gat", "gcn", "gin", "hf_vision", "open_clip", "wav2vec2", "whisper_hf"),
    "projectors": ("identity", "linear", "mlp", "perceiver", "stack_swiglu"),
    "preprocessors": ("log_mel",),
}


def describe_parts(parts: dict[str, tuple[str, ...]] | None = None) -> str:
    """One `# kind: name, name, ...` line per kind of part (the built-ins unless `parts` is given)."""
    table = parts or BUILTIN_PARTS
    return "\n".join(f"# {kind}: {', '.join(sorted(names))}" for kind, names in table.items())
