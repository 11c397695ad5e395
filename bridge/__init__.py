"""bridge: the hall that joins `encoders/` and `runner/`: the Bridge API, recipes, training, the wire
format and the CLI.

Heavy parts (training, the Bridge API) are imported lazily so that `import bridge` stays cheap for
the wire format and the CLI's argument parsing.
"""

from bridge.wire import DEFAULT_MAX_PROMPT_EMBEDS_BYTES, encode_prompt_embeds, load_prompt_embeds

__all__ = ["DEFAULT_MAX_PROMPT_EMBEDS_BYTES", "Bridge", "encode_prompt_embeds", "load_prompt_embeds"]


def __getattr__(name: str):
    if name == "Bridge":
        from bridge.api import Bridge

        return Bridge
    raise AttributeError(f"module 'bridge' has no attribute {name!r}")
