"""`bridge serve RUN_DIR` over a tiny trained Bridge checkpoint (the shapes demo, a few steps), started
as the README prints it: chat with an image, rendered with the template the run's recipe gives (its
tokenizer has none), equals `Bridge.from_checkpoint(...).generate` token for token, a repeated image
is encoded once, images over the request's pixel budget and parts over the item limit are refused
before anything is decoded, and SIGTERM lets a running stream finish, then exits 0."""

from __future__ import annotations

import base64
import io
import json
import shlex
import signal
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from helpers import png_header
from serve_helpers import TEMPLATE_FILE, ServerProcess

from bridge.cli import main
from bridge.data.sources import build_datasets
from bridge.recipe import load_recipe

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def shapes_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("serve_shapes") / "shapes"
    args = ["demo", "shapes", "--output-dir", str(out), "train.max_steps=2", "train.progress=false",
            "eval.num_items=2", "data.num_train=16", "data.num_eval=4", "train.batch_size=4"]
    assert main(args) == 0
    return out


@pytest.fixture(scope="module")
def images():
    recipe = load_recipe(ROOT / "recipes" / "demo" / "shapes.yaml", ["data.num_train=16", "data.num_eval=4"])
    _, held_out = build_datasets(recipe.data, recipe.seed)
    return [held_out[i].media["image"][0] for i in range(2)]


def readme_serve_lines() -> list[list[str]]:
    """The `bridge serve ...` command lines of the README's Serve section, split as a shell would."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("\n## Serve\n"):]
    section = section[:section.index("\n## ", 1)]
    return [shlex.split(line.split("#", 1)[0]) for line in section.splitlines()
            if line.strip().startswith("bridge serve ")]


def test_the_readme_serve_lines_name_files_that_exist():
    lines = readme_serve_lines()
    assert any(line[2] == "runs/shapes" for line in lines), lines
    templates = [line[i + 1] for line in lines for i, arg in enumerate(line) if arg == "--chat-template"]
    assert templates, "the README shows --chat-template"
    for name in templates:
        assert (ROOT / name).is_file(), f"the README's --chat-template {name} is not in the repository"
    assert (ROOT / templates[0]).resolve() == TEMPLATE_FILE.resolve()  # the one the server tests use


@pytest.fixture(scope="module")
def run_server(shapes_run, tmp_path_factory):
    """The README's `bridge serve runs/shapes ...` line as printed (its port replaced by a free one, run
    from the repository root), with a small KV cache for the test box and the info log."""
    line = next(line for line in readme_serve_lines() if line[2] == "runs/shapes")
    flags = line[3:]
    if "--port" in flags:
        at = flags.index("--port")
        del flags[at:at + 2]
    log = tmp_path_factory.mktemp("serve_ckpt") / "server.log"
    server = ServerProcess(shapes_run, log, *flags, "--max-model-len", "96", "--num-kv-blocks", "64",
                           "--log-level", "info")
    yield server
    server.stop()


def _data_url(image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _image_message(image) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": _data_url(image)}}]}]


@pytest.fixture(scope="module")
def bridge_api(shapes_run):
    from bridge.api import Bridge

    return Bridge.from_checkpoint(shapes_run, device="cpu")


def test_chat_with_an_image_equals_the_bridge_api_and_encodes_once(run_server, bridge_api, images):
    outs = bridge_api.generate([{"text": "<image>", "image": im} for im in images], max_tokens=8)
    want = [o.outputs[0].text for o in outs]
    client = openai.OpenAI(base_url=run_server.url + "/v1", api_key="none", max_retries=0, timeout=60)
    before = run_server.metrics()
    got = []
    for image, out in zip(images, outs):
        r = client.chat.completions.create(model="shapes", messages=_image_message(image), temperature=0.0,
                                           max_tokens=8, extra_body={"return_token_ids": True})
        got.append(r.choices[0].message.content)
        assert r.choices[0].model_dump()["token_ids"] == out.outputs[0].token_ids
    assert got == want
    for _ in range(3):  # the first image again: served from the encoder cache
        r = client.chat.completions.create(model="shapes", messages=_image_message(images[0]),
                                           temperature=0.0, max_tokens=8)
        assert r.choices[0].message.content == want[0]
    m = run_server.metrics()
    assert m["bridge:encoder_encoded_items"] - before["bridge:encoder_encoded_items"] == 2
    assert m["bridge:encoder_cache_hits_total"] - before.get("bridge:encoder_cache_hits_total", 0) == 3
    assert m["bridge:encoder_cache_queries_total"] - before.get("bridge:encoder_cache_queries_total", 0) == 5
    run_server.wait_idle()


def test_media_errors_name_the_part_and_the_flag(run_server, images):
    with httpx.Client(base_url=run_server.url, timeout=30) as http:
        r = http.post("/v1/completions", json={"prompt": "", "prompt_embeds": "AAAA", "max_tokens": 2})
        assert r.status_code == 400 and "--enable-prompt-embeds" in r.json()["error"]["message"]
        audio = [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "AAAA"}}]}]
        r = http.post("/v1/chat/completions", json={"messages": audio, "max_tokens": 2})
        assert r.status_code == 400 and "no audio encoder" in r.json()["error"]["message"]
        local = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "/etc/passwd"}}]}]
        r = http.post("/v1/chat/completions", json={"messages": local, "max_tokens": 2})
        assert r.status_code == 400 and "--allowed-local-media-path" in r.json()["error"]["message"]
        assert r.json()["error"]["param"] == "messages[0].content[0]"
    run_server.wait_idle()


def test_images_over_the_request_budget_are_refused_from_their_headers(run_server):
    """Eight images of 8192 x 8192 (each at the old per-image cap): refused from the first header, none
    decoded (each PNG holds a few bytes of pixels, so a decode would fail with another message)."""
    url = "data:image/png;base64," + base64.b64encode(png_header(8192, 8192)).decode()
    part = {"type": "image_url", "image_url": {"url": url}}
    r = httpx.post(run_server.url + "/v1/chat/completions", timeout=30, json={
        "messages": [{"role": "user", "content": [part] * 8}], "max_tokens": 2})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "messages[0].content[0]"
    assert "image pixels" in error["message"] and "--max-image-pixels" in error["message"]
    run_server.wait_idle()


def test_more_media_parts_than_the_limit_are_refused_before_any_is_read(run_server):
    junk = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}  # no image at all
    r = httpx.post(run_server.url + "/v1/chat/completions", timeout=30, json={
        "messages": [{"role": "user", "content": [junk] * 40}, {"role": "user", "content": [junk] * 25}],
        "max_tokens": 2})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "messages[1].content[24]" and "more than 64 media items" in error["message"]
    assert "--max-media-items" in error["message"]


def test_a_run_without_a_tokenizer_template_chats_in_its_recipe_prompt_format(run_server, bridge_api, images):
    """The run's tokenizer has no chat template: the server renders with the one its recipe's data.prompt
    gives (logged once), so a user turn holding the image and text is the prompt Bridge.generate builds
    from the same item, token for token: the prompt ids (placeholder expanded) and the answer's."""
    assert bridge_api.tokenizer.chat_template is None
    text = "what shape is this"
    item = {"prompt": "<image>\n" + text, "image": images[0]}  # data.prompt "<image>": parts joined by "\n"
    want = bridge_api.generate([item], max_tokens=8)[0]
    (request,) = bridge_api.build_requests([item])
    message = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": _data_url(images[0])}},
                                            {"type": "text", "text": text}]}]
    r = httpx.post(run_server.url + "/v1/chat/completions", timeout=60, json={
        "model": "shapes", "messages": message, "max_tokens": 8, "temperature": 0.0,
        "return_token_ids": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["prompt_token_ids"] == request["prompt_token_ids"]
    assert body["choices"][0]["token_ids"] == want.outputs[0].token_ids
    assert body["choices"][0]["message"]["content"] == want.outputs[0].text
    log = run_server.log_path.read_text(errors="replace")
    assert log.count("chat template: the run's recipe data.prompt '<image>'") == 1, log[-2000:]
    run_server.wait_idle()


def test_the_chat_template_order_and_the_recipe_separator(shapes_run, tmp_path):
    from bridge.serve.chat_template import recipe_part_separator, resolve_chat_template
    from runner.llm import load_tokenizer

    assert [recipe_part_separator(p) for p in ("<image>", "<image>\nDescribe the image.", "Describe: <image>",
                                               "<image>Name it", "<audio> \n Transcribe:")] == \
        ["\n", "\n", " ", "", " \n "]
    tokenizer = load_tokenizer(shapes_run / "checkpoints" / "step_2" / "llm")
    recipe = resolve_chat_template(None, tokenizer, shapes_run)
    assert recipe.special_prefix and recipe.part_separator == "\n" and "'<image>'" in recipe.origin
    own = resolve_chat_template(str(TEMPLATE_FILE), tokenizer, shapes_run)  # --chat-template wins
    assert own.source == TEMPLATE_FILE.read_text() and not own.special_prefix
    tokenizer.chat_template = "{{ messages[0]['content'] }}"  # then the tokenizer's own
    assert resolve_chat_template(None, tokenizer, shapes_run).source is None
    tokenizer.chat_template = None
    plain = tmp_path / "model"  # a HF model dir with no template and no run around it: none
    plain.mkdir()
    (plain / "config.json").write_text("{}")
    assert resolve_chat_template(None, tokenizer, plain) is None


def test_sigterm_lets_the_running_stream_finish_then_exits_0(run_server, images):
    body = {"model": "shapes", "messages": _image_message(images[1]), "max_tokens": 40, "ignore_eos": True,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
    first_chunk = threading.Event()
    result: dict = {}

    def stream() -> None:
        chunks = []
        with httpx.stream("POST", run_server.url + "/v1/chat/completions", json=body, timeout=60) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    chunks.append(line[6:])
                    first_chunk.set()
        result["chunks"] = chunks

    thread = threading.Thread(target=stream)
    thread.start()
    assert first_chunk.wait(30)
    run_server.proc.send_signal(signal.SIGTERM)
    thread.join(60)
    assert not thread.is_alive()
    chunks = result["chunks"]
    assert chunks[-1] == "[DONE]"
    usage = json.loads(chunks[-2])["usage"]
    assert usage["completion_tokens"] == 40
    assert run_server.proc.wait(timeout=60) == 0, run_server.log()
    deadline = time.monotonic() + 5
    with pytest.raises(httpx.ConnectError):
        while time.monotonic() < deadline:  # the port is closed once the process is gone
            httpx.get(run_server.url + "/health", timeout=2)
            time.sleep(0.1)
