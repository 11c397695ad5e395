"""bridge: the hall that joins `encoders/` and `runner/`: the Bridge API, recipes, training, the wire
format and the CLI.

Every export is imported on first use, so that `import bridge` (which the `bridge` console script
does before anything else) loads no torch: the CLI's help and usage errors answer at once.
"""

__all__ = ["DEFAULT_MAX_PROMPT_EMBEDS_BYTES", "Bridge", "encode_prompt_embeds", "load_prompt_embeds"]

_WIRE = ("DEFAULT_MAX_PROMPT_EMBEDS_BYTES", "encode_prompt_embeds", "load_prompt_embeds")


def __getattr__(name: str):
    if name == "Bridge":
        from bridge.api import Bridge

        return Bridge
    if name in _WIRE:
        from bridge import wire

        return getattr(wire, name)
    raise AttributeError(f"module 'bridge' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
