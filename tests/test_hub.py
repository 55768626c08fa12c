"""Export -> verify -> push -> load back by repo id, against the local Hub server (tests/support/local_hub.py).

Every client step runs in a fresh subprocess whose environment points the real ``huggingface_hub``
and ``transformers`` at the local server (``HF_ENDPOINT``), with an empty ``HF_HOME`` and
``HF_HUB_DISABLE_XET=1`` set before they are imported.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from local_hub import TEST_TOKEN as HUB_TOKEN, TEST_USER as HUB_USER

from polar_vit_hf.conversion.export import export
from polar_vit_hf.conversion.verify import folder_digest, verify

pytestmark = pytest.mark.slow  # processes, training runs or compiles: `make test-fast` skips them

REPO = f"{HUB_USER}/polar-vit-digits"
PUSH = ["-m", "polar_vit_hf.conversion.push"]
VERIFY = ["-m", "polar_vit_hf.conversion.verify"]


@pytest.fixture(scope="module")
def verified_export(digits_run, tmp_path_factory) -> Path:
    """The short digits run, exported (sharded: the index path of from_pretrained is exercised over
    HTTP too) with its card and verified (offline) as push.py requires."""
    out = export(
        digits_run, tmp_path_factory.mktemp("export") / "polar-vit-digits", repo_id=REPO, max_shard_size="100KB"
    )
    assert verify(out, source=digits_run)
    return out


def run(
    args: list[str], env: dict[str, str], timeout: int = 900, cwd: Path | None = None
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        env={**env, "OMP_NUM_THREADS": "1"},
        cwd=cwd,
        timeout=timeout,
    )


def client(code: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    """Run a client script in a fresh interpreter (the HF libraries see only the given environment)."""
    return run(["-c", textwrap.dedent(code)], env)


def test_push_then_load_back_by_repo_id_with_and_without_the_package(local_hub, verified_export, tmp_path):
    env = local_hub.client_env(tmp_path / "hf-home", HUB_TOKEN)
    pushed = run([*PUSH, str(verified_export), REPO, "--message", "Polar-ViT digits demo"], env)
    assert pushed.returncode == 0, pushed.stderr[-3000:]
    assert f"{local_hub.endpoint}/{REPO}/commit/" in pushed.stdout
    repo = local_hub.repos[REPO]
    head = repo.commits[repo.branches["main"]]
    assert head.title == "Polar-ViT digits demo"
    assert set(head.files) == {".gitattributes", *folder_digest(verified_export)}  # the marker stays local
    shards = [name for name in head.files if name.endswith(".safetensors")]
    assert len(shards) > 1 and "model.safetensors.index.json" in head.files
    assert all(head.files[name].sha256 is not None for name in shards)  # weights went through LFS
    assert head.files["config.json"].sha256 is None and head.files["config.json"].content is not None

    # from the Hub, into empty caches: snapshot_download + SHA-256 of every file, then
    # AutoModelForImageClassification.from_pretrained(REPO) and pipeline(model=REPO) with the package
    # installed and with trust_remote_code=True where it is not importable
    checked = run([*VERIFY, REPO, "--source", str(verified_export)], env)
    assert checked.returncode == 0, checked.stdout + checked.stderr[-3000:]
    assert "SHA-256 equal to" in checked.stdout
    assert checked.stdout.count(" ok") == 2, checked.stdout
    assert "module transformers_modules" in checked.stdout  # the remote-code load used the downloaded files
    downloads = [path for method, path in local_hub.requests if method == "GET" and "/resolve/" in path]
    assert any(path.endswith("/modeling_polar_vit.py") for path in downloads)
    assert any(path.startswith(f"/api/models/{REPO}") for _, path in local_hub.requests)  # pipeline_tag lookup
    assert local_hub.unhandled == []

    # pushing the same folder again changes nothing: unchanged files are skipped, no new commit
    again = run([*PUSH, str(verified_export), REPO], env)
    assert again.returncode == 0, again.stderr[-3000:]
    assert repo.branches["main"] == head.oid


def test_private_repo_on_a_branch_needs_the_token_and_the_revision(local_hub, verified_export, tmp_path):
    private = f"{HUB_USER}/polar-vit-private"
    with_token = local_hub.client_env(tmp_path / "home-1", HUB_TOKEN)
    pushed = run([*PUSH, str(verified_export), private, "--private", "--revision", "dev"], with_token)
    assert pushed.returncode == 0, pushed.stderr[-3000:]
    assert local_hub.repos[private].private
    code = f"""
        import polar_vit_hf, transformers
        from huggingface_hub import hf_hub_download
        from huggingface_hub.errors import EntryNotFoundError, RepositoryNotFoundError
        try:
            hf_hub_download({private!r}, "config.json", revision="dev")
            print("downloaded")
        except RepositoryNotFoundError:
            print("repo not found")
        try:
            hf_hub_download({private!r}, "config.json")  # main has only .gitattributes
        except EntryNotFoundError:
            print("entry not found on main")
        except RepositoryNotFoundError:
            print("repo not found on main")
        try:
            model = transformers.AutoModelForImageClassification.from_pretrained({private!r}, revision="dev")
            print("loaded", type(model).__name__, model.config.num_labels)
        except OSError as error:
            print("OSError", str(error).splitlines()[0])
        """
    anonymous = client(code, local_hub.client_env(tmp_path / "home-2"))
    assert anonymous.returncode == 0, anonymous.stderr[-3000:]
    assert anonymous.stdout.splitlines() == [
        "repo not found",
        "repo not found on main",
        anonymous.stdout.splitlines()[2],
    ]
    assert anonymous.stdout.splitlines()[2].startswith("OSError") and private in anonymous.stdout
    owner = client(code, with_token)
    assert owner.returncode == 0, owner.stderr[-3000:]
    assert owner.stdout.splitlines() == [
        "downloaded",
        "entry not found on main",
        "loaded PolarViTForImageClassification 10",
    ]


def test_push_refuses_without_a_valid_token_or_into_another_namespace(local_hub, verified_export, tmp_path):
    no_token = run([*PUSH, str(verified_export), f"{HUB_USER}/x"], local_hub.client_env(tmp_path))
    assert no_token.returncode == 2 and "no Hugging Face token" in no_token.stderr
    bad = run([*PUSH, str(verified_export), f"{HUB_USER}/x"], local_hub.client_env(tmp_path, "hf_bad"))
    assert bad.returncode == 1 and "the Hub refused the upload" in bad.stderr and "401" in bad.stderr
    foreign = run([*PUSH, str(verified_export), "someone-else/x"], local_hub.client_env(tmp_path, HUB_TOKEN))
    assert foreign.returncode == 1 and "403" in foreign.stderr
    assert f"{HUB_USER}/x" not in local_hub.repos and "someone-else/x" not in local_hub.repos
    absent = run(
        [*VERIFY, f"{HUB_USER}/absent", "--source", str(verified_export)], local_hub.client_env(tmp_path, HUB_TOKEN)
    )
    assert absent.returncode == 1 and "FAILED" in absent.stdout and "RepositoryNotFoundError" in absent.stdout


def request(
    method: str,
    url: str,
    body: bytes | None = None,
    token: str | None = HUB_TOKEN,
    content_type: str = "application/json",
) -> tuple[int, dict[str, str], bytes]:
    headers = {"Content-Type": content_type, **({"Authorization": f"Bearer {token}"} if token else {})}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, body, headers, method=method)) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), error.read()


def test_local_hub_error_semantics(local_hub):
    """The server itself (test infrastructure): the status codes and headers the client relies on."""
    hub = local_hub.endpoint
    status, _, body = request("POST", f"{hub}/api/repos/create", json.dumps({"name": "semantics"}).encode())
    assert status == 200 and json.loads(body)["url"] == f"{hub}/{HUB_USER}/semantics"
    status, _, body = request("POST", f"{hub}/api/repos/create", json.dumps({"name": "semantics"}).encode())
    assert status == 409 and "url" in json.loads(body)  # create_repo(exist_ok=True) reads it
    head = local_hub.repos[f"{HUB_USER}/semantics"].branches["main"]
    status, headers, _ = request("GET", f"{hub}/{HUB_USER}/semantics/resolve/main/missing.json")
    assert status == 404 and headers["X-Error-Code"] == "EntryNotFound" and headers["X-Repo-Commit"] == head
    status, headers, _ = request("GET", f"{hub}/{HUB_USER}/semantics/resolve/nope/.gitattributes")
    assert status == 404 and headers["X-Error-Code"] == "RevisionNotFound"
    status, headers, _ = request("HEAD", f"{hub}/{HUB_USER}/absent/resolve/main/config.json", token=None)
    assert status == 401 and headers["X-Error-Code"] == "RepoNotFound"
    status, headers, _ = request("GET", f"{hub}/{HUB_USER}/semantics/resolve/{head}/.gitattributes")
    assert status == 200 and headers["X-Repo-Commit"] == head and headers["ETag"].startswith('"')
    # LFS: content must hash to its oid; a commit may not reference an object never uploaded;
    # a stale parentCommit is refused
    status, _, _ = request(
        "PUT", f"{local_hub.storage}/lfs/{'0' * 64}", b"not these bytes", content_type="application/octet-stream"
    )
    assert status == 400
    commit = f"{hub}/api/models/{HUB_USER}/semantics/commit/main"
    lines = [
        {"key": "header", "value": {"summary": "s"}},
        {"key": "lfsFile", "value": {"path": "w.safetensors", "algo": "sha256", "oid": "1" * 64, "size": 3}},
    ]
    body = b"\n".join(json.dumps(x).encode() for x in lines)
    status, _, _ = request("POST", commit, body, content_type="application/x-ndjson")
    assert status == 422
    lines = [{"key": "header", "value": {"summary": "s", "parentCommit": "f" * 40}}]
    status, _, _ = request("POST", commit, json.dumps(lines[0]).encode(), content_type="application/x-ndjson")
    assert status == 412
    status, _, _ = request("GET", f"{hub}/api/spaces/{HUB_USER}/semantics")
    assert status == 501 and local_hub.unhandled[-1] == ("GET", f"/api/spaces/{HUB_USER}/semantics")
    local_hub.unhandled.clear()


def test_model_and_processor_push_to_hub_then_remote_code_load(local_hub, tmp_path):
    """The standard ``PreTrainedModel.push_to_hub`` path ships the modeling files and the full auto_map."""
    repo = f"{HUB_USER}/pushed-directly"
    push = client(
        f"""
        import torch, polar_vit_hf as P
        torch.manual_seed(0)
        model = P.PolarViTForImageClassification(P.PolarViTConfig.from_preset("demo", num_labels=3))
        model.push_to_hub({repo!r})
        P.PolarViTImageProcessor(size={{"height": 32, "width": 32}}).push_to_hub({repo!r})
        torch.save(model(torch.ones(1, 3, 32, 32)).logits, {str(tmp_path / "logits.pt")!r})
        """,
        local_hub.client_env(tmp_path / "home-push", HUB_TOKEN),
    )
    assert push.returncode == 0, push.stderr[-3000:]
    files = local_hub.repos[repo].commits[local_hub.repos[repo].branches["main"]].files
    assert {"modeling_polar_vit.py", "geometry.py", "config.json", "preprocessor_config.json"} <= set(files)
    load = client(
        f"""
        import sys
        sys.modules["polar_vit_hf"] = None
        import torch
        from transformers import AutoImageProcessor, AutoModelForImageClassification
        model = AutoModelForImageClassification.from_pretrained({repo!r}, trust_remote_code=True).eval()
        processor = AutoImageProcessor.from_pretrained({repo!r}, trust_remote_code=True)
        expected = torch.load({str(tmp_path / "logits.pt")!r})
        print(type(processor).__name__, float((model(torch.ones(1, 3, 32, 32)).logits - expected).abs().max()))
        """,
        local_hub.client_env(tmp_path / "home-load"),
    )
    assert load.returncode == 0, load.stderr[-3000:]
    assert load.stdout.split() == ["PolarViTImageProcessor", "0.0"]
