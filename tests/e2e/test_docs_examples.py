"""The README's and docs/client.md's examples, run as a new user runs them: copied out of the documents, against a
gateway serving docs/upstreams.sample.yaml as it is but for its upstreams' addresses (the test upstream double,
which echoes), so every example answers at once. Only the gateway's address, the key printed at start and the key
ids the documents make up are put in; an example that stops working, or prints something other than the document
leads one to expect, fails here before a user copies it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from gateway.envoy import repo_root
from tests.e2e.conftest import running_gateway

ROOT = repo_root()
PORTICO = Path(sys.executable).parent / "portico"  # `.venv/bin/portico` of the documents
SAMPLE_KEYS = ("UPSTREAM_KEY", "OPENAI_API_KEY", "ANTHROPIC_API_KEY")  # the sample's start command sets these


def blocks(document: str, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", (ROOT / document).read_text(), re.S | re.M)


@pytest.fixture(scope="module")
def gateway(double, tmp_path_factory):
    """docs/upstreams.sample.yaml with each upstream (OpenAI's, Anthropic's, the local servers) at the double."""
    origin = double.url.removesuffix("/v1")
    sample = (ROOT / "docs" / "upstreams.sample.yaml").read_text()
    config = re.sub(r"https://api\.(openai|anthropic)\.com|http://127\.0\.0\.1:\d+", origin, sample)
    assert config.count(origin) == 7, "the sample's upstream addresses changed: update this test"
    directory = tmp_path_factory.mktemp("docs-examples")
    (directory / "portico.yaml").write_text(config)
    os.environ.update({name: "sk-docs-example-upstream" for name in SAMPLE_KEYS})
    try:
        with running_gateway(directory / "data", config=directory / "portico.yaml") as gateway:
            yield gateway
    finally:
        for name in SAMPLE_KEYS:
            os.environ.pop(name, None)


def run_python(code: str, gateway, cwd: Path) -> str:
    code = code.replace("127.0.0.1:8080", f"127.0.0.1:{gateway.port}")
    done = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PORTICO_KEY": gateway.secret})
    assert done.returncode == 0, f"{code}\n{done.stderr}"
    return done.stdout


def test_the_readme_python_examples_run_as_written(gateway, tmp_path):
    sdk_openai, sdk_anthropic, typed_grpc, client = blocks("README.md", "python")
    listed = run_python(sdk_openai, gateway, tmp_path)
    assert "family-a-5.5 /v1/chat/completions\n" in listed and "family-b-sonnet-4-6 /v1/messages\n" in listed
    assert listed.endswith("echo Write a haiku about gateways.")  # the stream, chunk by chunk
    assert run_python(sdk_anthropic, gateway, tmp_path) == "echo Say hello.\n"
    assert run_python(typed_grpc, gateway, tmp_path) == "echo Say hello.\n"
    assert run_python(client, gateway, tmp_path) == "family-a-5.5 echo Say hello.\n"


def test_the_client_guide_examples_run_as_written(gateway, tmp_path):
    """docs/client.md's blocks continue one another: `client` from the first, `messages` and `api_key` as a
    caller has them, the asyncio one inside the coroutine it needs."""
    first, with_id, queue, asynchronous = blocks("docs/client.md", "python")
    (aliases,) = blocks("docs/client.md", "yaml")
    (tmp_path / "models.yaml").write_text(aliases)
    prelude = 'import os\napi_key = os.environ["PORTICO_KEY"]\nmessages = [{"role": "user", "content": "Hi"}]\n'
    shown = "print(message.content[0].text, count.input_tokens)\nprint(summary.model)\n"
    later = "aliases = ModelAliases.load('models.yaml')\nasync def main():\n" + textwrap.indent(asynchronous, "    ")
    later += "    print(completion.model)\nimport asyncio\nasyncio.run(main())\n"
    printed = run_python(prelude + first + with_id + queue + shown + later, gateway, tmp_path).splitlines()
    assert printed[0] == "family-a-5.5 echo Hi"
    assert re.fullmatch(r"[0-9a-f-]{36} echo Hi", printed[1])  # call_with_id: the request id, then the answer
    assert printed[2].startswith("echo Hi ")  # the message of the "writer" alias and its token count
    assert printed[3:] == ["family-a-5.4", "family-a-5.5"]


def shell_lines(document: str) -> list[str]:
    """The documents' shell commands, a line continued with `\\` joined to the next, comments left out."""
    lines = []
    for block in blocks(document, "sh"):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            if line and not line.startswith("#"):
                lines.append(line)
    return lines


def test_the_readme_commands_run_as_written(gateway):
    """Every `portico` and `curl` line of the README (but `make`'s and the Redis one's), as an operator types them,
    in order: the key ids the README makes up are the key its `keys create` made."""
    key_id = ""
    ran = 0
    for line in shell_lines("README.md"):
        if line.startswith(("make", "export")) or "--workers" in line:
            continue
        line = line.replace("$PORTICO_KEY", gateway.secret).replace("127.0.0.1:8080", f"127.0.0.1:{gateway.port}")
        line = line.replace("key_0123456789abcdef", key_id)
        if line.startswith(".venv/bin/portico"):
            line = f"{PORTICO}{line.removeprefix('.venv/bin/portico')}"
            line += f" --config {gateway.data_dir.parent / 'portico.yaml'} --data-dir {gateway.data_dir}"
        done = subprocess.run(line, shell=True, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0 and not done.stderr, f"{line}\n{done.stdout}{done.stderr}"
        if " keys create " in line:
            key_id = re.match(r"Created key (key_[0-9a-f]{16}) ", done.stdout)[1]
        if line.startswith("curl"):
            assert '"error"' not in done.stdout, f"{line}\n{done.stdout}"
        ran += 1
    assert ran == 10 and key_id


def test_the_operations_guide_key_commands_run_as_written(gateway):
    """operations.md's keys per environment: each `portico keys create` line makes its key, and `portico keys list`
    shows the env in the fourth column, as the guide says an operator joins spend per business line by."""
    made = []
    for line in shell_lines("docs/operations.md"):
        assert line.startswith("portico keys create "), line
        done = subprocess.run(f"{PORTICO}{line.removeprefix('portico')} --data-dir {gateway.data_dir}", shell=True,
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0 and not done.stderr, f"{line}\n{done.stdout}{done.stderr}"
        made.append((re.match(r"Created key (key_[0-9a-f]{16}) ", done.stdout)[1],
                     re.search(r"--env (\S+)", line)[1], "--admin" in line))
    listed = {row.split("\t")[0]: row.split("\t") for row in gateway.cli("keys", "list").stdout.splitlines()}
    assert len(made) == 4
    for key_id, env, admin in made:
        assert listed[key_id][3] == env and listed[key_id][2] == ("active admin" if admin else "active")
