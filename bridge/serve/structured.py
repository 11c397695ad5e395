"""A request body's output constraint: vLLM's `structured_outputs` or OpenAI's `response_format`.

Both become one `runner.StructuredOutputsParams`, checked here, in the API process, before anything is
submitted: the fields' shapes, then the schema, regex or grammar converted by the same code the engine
compiles with (no tokenizer needed). A bad one is a 400 naming the field (`structured_outputs.json`,
`response_format.json_schema.schema`, ...), never a failure inside the engine's tick.
"""

from __future__ import annotations

from bridge.serve.errors import ApiError
from bridge.serve.protocol import ChatCompletionRequest, CompletionRequest
from runner.engine.structured_outputs import check_structured_outputs
from runner.sampling_params import StructuredOutputsParams


def _from_structured_outputs(body: CompletionRequest | ChatCompletionRequest) -> StructuredOutputsParams:
    so = body.structured_outputs
    fields = {"json": so.json_schema, "regex": so.regex, "choice": so.choice, "grammar": so.grammar,
              "json_object": so.json_object}
    try:
        return StructuredOutputsParams(**fields, disable_any_whitespace=so.disable_any_whitespace)
    except ValueError as exc:
        given = [k for k, v in fields.items() if v is not None]
        raise ApiError(400, str(exc), param=f"structured_outputs.{given[0]}" if len(given) == 1
                       else "structured_outputs") from None


def _from_response_format(body: CompletionRequest | ChatCompletionRequest) -> StructuredOutputsParams | None:
    fmt = body.response_format
    if fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    where = "response_format.json_schema.schema"
    if fmt.json_schema is None or fmt.json_schema.json_schema is None:
        raise ApiError(400, f"{where} is required with response_format type json_schema", param=where)
    try:
        return StructuredOutputsParams(json=fmt.json_schema.json_schema)
    except ValueError as exc:
        detail = str(exc).removeprefix("structured_outputs.json").lstrip(": ")
        raise ApiError(400, f"{where}: {detail}", param=where) from None


def structured_outputs(body: CompletionRequest | ChatCompletionRequest) -> StructuredOutputsParams | None:
    """The body's output constraint, checked (None: unconstrained); `ApiError(400)` naming the field."""
    if body.structured_outputs is not None and body.response_format is not None \
            and body.response_format.type != "text":
        raise ApiError(400, "give structured_outputs or response_format, not both", param="response_format")
    if body.structured_outputs is not None:
        params = _from_structured_outputs(body)
        where = f"structured_outputs.{params.kind}"
    elif body.response_format is not None:
        params = _from_response_format(body)
        where = "response_format.json_schema.schema"
    else:
        return None
    if params is None:
        return None
    try:
        check_structured_outputs(params, where)
    except ValueError as exc:
        raise ApiError(400, str(exc), param=where) from None
    return params


__all__ = ["structured_outputs"]
