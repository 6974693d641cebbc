"""`python -m bench --litellm`: the same load against the LiteLLM proxy, for the comparison issue 6 asks for.

LiteLLM lives in its own venv, `.cache/bench-litellm-venv/` under the repository root, created on first use with
`python -m venv` and `pip install "litellm[proxy]==VERSION"` (a few minutes and ~750 MB, once). The proxy is then
started from that venv as

    litellm --config <run dir>/litellm.yaml --host 127.0.0.1 --port <free> --num_workers <--workers>

with family-a-5.5 and family-b-sonnet-4-6 pointing at the same mock (`openai/mock-gpt`, a dummy upstream key), no
database, a master key (the load sends it as `Authorization: Bearer`, as it sends Portico's key), no callbacks,
logging at ERROR, the local model cost map (no fetch from the internet at start), and /v1/messages translated to
chat completions (LITELLM_USE_CHAT_COMPLETIONS_URL_FOR_ANTHROPIC_MESSAGES; without it LiteLLM sends an
OpenAI-backed model's /v1/messages to the upstream's Responses API, which the mock does not serve). The wrk runs,
the paced run and the open streams are the same as Portico's, with the same bodies; the CPU and memory columns are
LiteLLM's process tree.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from bench.common import (CHAT_BODY, MESSAGES_BODY, PYTHON, ROOT, STREAM_BODY, Processes, Row, lua_script,
                          open_streams, paced, post, process_names, pss_bytes, rss_bytes, run_wrk, settle, tree,
                          wait_port)

# litellm[proxy] pinned: the reference figures (~110 JSON req/s, 1 worker) were taken with a 1.106 proxy. 1.106.2 is
# the newest 1.106.x that installs from the package mirror here: 1.106.3 and later require certifi>=2026.10.19,
# which the mirror does not have.
VERSION = "1.106.2"
VENV = ROOT / ".cache" / "bench-litellm-venv"
MASTER_KEY = "sk-bench-litellm"  # LiteLLM wants master keys to start with sk-
UPSTREAM_KEY = "sk-bench-mock"
MODELS = {"family-a-5.5": "mock-gpt", "family-b-sonnet-4-6": "mock-gpt", "family-a-5.4": "mock-slow"}


def _installed(python: Path) -> str | None:
    if not python.exists():
        return None
    out = subprocess.run([str(python), "-c", "import importlib.metadata as m; print(m.version('litellm'))"],
                         capture_output=True, text=True, timeout=60)
    return out.stdout.strip() if out.returncode == 0 else None


def ensure_venv() -> Path:
    """The `litellm` command of the cached venv, installing litellm[proxy]==VERSION there when it is not."""
    python, command = VENV / "bin" / "python", VENV / "bin" / "litellm"
    if command.exists() and _installed(python) == VERSION:
        return command
    log = VENV.parent / "bench-litellm-install.log"
    print(f"bench: installing litellm[proxy]=={VERSION} into {VENV.relative_to(ROOT)} (once; a few minutes); "
          f"log: {log.relative_to(ROOT)}", flush=True)
    VENV.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        pip = [str(python), "-m", "pip", "install", "--disable-pip-version-check", f"litellm[proxy]=={VERSION}"]
        for step in ([PYTHON, "-m", "venv", str(VENV)] if not python.exists() else [], pip):
            if step and subprocess.run(step, stdout=out, stderr=subprocess.STDOUT).returncode != 0:
                tail = "".join(line for line in log.read_text().splitlines(keepends=True)[-15:]
                               if not line.startswith("WARNING: Location"))
                raise RuntimeError(f"installing LiteLLM failed ({' '.join(step[:4])} ...):\n{tail}")
    if _installed(python) != VERSION:
        raise RuntimeError(f"litellm {VERSION} is not importable in {VENV} after installing it; see {log}")
    return command


def config(mock_port: int) -> dict:
    base = f"http://127.0.0.1:{mock_port}/v1"
    return {
        "model_list": [{"model_name": name, "litellm_params": {"model": f"openai/{upstream}", "api_base": base,
                                                                "api_key": UPSTREAM_KEY}}
                       for name, upstream in MODELS.items()],
        "litellm_settings": {"set_verbose": False, "json_logs": False, "callbacks": [], "success_callback": [],
                             "failure_callback": []},
        "general_settings": {"master_key": MASTER_KEY, "disable_spend_logs": True, "disable_error_logs": True},
    }


def environment() -> dict[str, str]:
    """The bench's environment without anything that would point LiteLLM at a database, a cache, a provider or the
    project's venv, plus LiteLLM's own settings for this run."""
    dropped = ("LITELLM_", "DATABASE_URL", "DIRECT_URL", "REDIS_", "OPENAI_", "ANTHROPIC_", "PYTHONPATH", "VIRTUAL_ENV")
    env = {k: v for k, v in os.environ.items() if not k.startswith(dropped)}
    env.update({
        "PATH": f"{VENV / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
        "PYTHONUNBUFFERED": "1",
        "LITELLM_LOG": "ERROR",
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
        "LITELLM_USE_CHAT_COMPLETIONS_URL_FOR_ANTHROPIC_MESSAGES": "True",
    })
    return env


def _wait_alive(base: str, proc: subprocess.Popen, seconds: float, log: Path) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        try:
            with urllib.request.urlopen(base + "/health/liveliness", timeout=2) as answer:
                if answer.status == 200:
                    return
        except (OSError, urllib.error.URLError):
            pass
        time.sleep(0.25)
    state = f"exited with {proc.returncode}" if proc.poll() is not None else f"not alive after {seconds:g} s"
    raise RuntimeError(f"litellm {state}:\n{log.read_text()[-3000:]}")


def smoke(base: str) -> str:
    """Each benchmarked request once through LiteLLM. Returns '' when /v1/messages works, else why it does not (that
    row is then skipped; the chat checks and the key check must pass)."""
    for body, marker in ((CHAT_BODY, b"fixed answer from the mock upstream"), (STREAM_BODY, b"[DONE]")):
        status, answer = post(base + "/v1/chat/completions", body, MASTER_KEY)
        if status != 200 or marker not in answer:
            raise RuntimeError(f"litellm smoke check stream={body.get('stream', False)} failed: {status} "
                               f"{answer[:300]!r}")
    status, answer = post(base + "/v1/chat/completions", CHAT_BODY, "sk-not-the-master-key")
    if not 400 <= status < 500:
        raise RuntimeError(f"litellm did not refuse a wrong key (status {status})")
    status, answer = post(base + "/v1/messages", MESSAGES_BODY, MASTER_KEY)
    if status != 200 or b"fixed answer from the mock upstream" not in answer:
        return f"not served for an OpenAI-backed model: {status} {answer[:160]!r}"
    return ""


def start(command: Path, args, run_dir: Path, procs: Processes, mock_port: int, port: int,
          results: dict) -> tuple[subprocess.Popen, str, str]:
    """The proxy, started, checked and described in `results`: (its process, base URL, why /v1/messages is
    skipped or '')."""
    config_path = run_dir / "litellm.yaml"
    config_path.write_text(json.dumps(config(mock_port), indent=2))  # JSON is YAML
    log = run_dir / "litellm.log"
    started = time.monotonic()
    proc = procs.start("litellm", [str(command), "--config", str(config_path), "--host", "127.0.0.1", "--port",
                                   str(port), "--num_workers", str(args.workers)],
                       cwd=run_dir, env=environment(), stdout=open(log, "w"), stderr=subprocess.STDOUT)
    wait_port(port, proc, 300, "litellm")
    base = f"http://127.0.0.1:{port}"
    _wait_alive(base, proc, 300, log)
    settle(proc.pid, 60)  # with --num_workers > 1 one worker may answer while another is still importing
    startup = time.monotonic() - started
    messages_skipped = smoke(base)
    time.sleep(1)
    pids = tree(proc.pid)
    info = {"version": VERSION, "workers": args.workers, "processes": process_names(proc.pid),
            "idle_rss_mb": round(rss_bytes(pids) / 2**20, 1), "idle_pss_mb": round(pss_bytes(pids) / 2**20, 1),
            "startup_s": round(startup, 1), "added_latency_p50_ms": None,
            "messages": messages_skipped or "served (translated to chat completions)"}
    results["litellm"] = info
    print(f"bench: {describe(info)}", flush=True)
    return proc, base, messages_skipped


def bench(command: Path, args, only: set[str], wrk: str, run_dir: Path, procs: Processes, helpers: list[int],
          mock_port: int, port: int, results: dict) -> list[Row]:
    proc, base, messages_skipped = start(command, args, run_dir, procs, mock_port, port, results)
    info = results["litellm"]
    rows: list[Row] = []
    lit = (proc.pid, helpers)
    for run, name, path, body in (("json", "litellm chat JSON", "/v1/chat/completions", CHAT_BODY),
                                  ("stream", "litellm chat stream", "/v1/chat/completions", STREAM_BODY),
                                  ("messages", "litellm /v1/messages", "/v1/messages", MESSAGES_BODY)):
        if run not in only:
            continue
        if run == "messages" and messages_skipped:
            rows.append(Row(name, note="skipped: /v1/messages " + messages_skipped))
            continue
        rows.append(run_wrk(wrk, name, base + path, lua_script(run_dir / "lua" / f"litellm-{run}.lua", body,
                                                               MASTER_KEY), args, lit, run_dir))
    if "latency" in only and args.latency_seconds > 0:
        paced_rows, info["added_latency_p50_ms"] = paced(args, mock_port, port, MASTER_KEY, lit, "LiteLLM")
        rows += paced_rows
    if "streams" in only and args.streams > 0:
        rows.append(open_streams(args, port, MASTER_KEY, lit, "litellm"))
    procs.stop(proc)
    return rows


def describe(info: dict) -> str:
    return (f"litellm {info['version']} proxy, --num_workers {info['workers']}: processes "
            f"{', '.join(info['processes'])}; idle RSS {info['idle_rss_mb']} MB (PSS {info['idle_pss_mb']}); "
            f"started in {info['startup_s']} s; /v1/messages {info['messages']}")
