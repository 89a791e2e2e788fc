"""A Node.js client of `RouterService.Generate` (issue 11): the wire contract works from
another language with nothing but the .proto files.

The test installs `@grpc/grpc-js` and `@grpc/proto-loader` from the npm registry into a
temporary folder and runs docs/clients.md's script: it loads
protos/epd/v1/router_service.proto at run time, sends a text chat
with the deployment's client key and compares the token ids with the Python client's. It
skips, naming the reason, where `node` or `npm` is absent or the npm registry cannot be
reached.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from common.models.tiny import make_tiny_checkpoint
from common.sampling import SamplingParams
from epd.client import Client
from tests.cluster import Cluster, start_cluster

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("@grpc/grpc-js@^1.14", "@grpc/proto-loader@^0.8")  # as docs/clients.md says
PROMPT = "Say something about the sea."
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)

DOC = ROOT / "docs" / "clients.md"
MARK = "<!-- tests/test_node_client.py runs the next block -->"


def doc_script() -> str:
    """docs/clients.md's Node.js client (argv: proto root, router address, API key, prompt,
    max tokens; prints the token ids as JSON), so that the page cannot go stale."""
    after = DOC.read_text().split(MARK, 1)[1]
    return after.split("```js\n", 1)[1].split("```", 1)[0]


def _run(args: list[str], timeout_s: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout_s, check=False)


@pytest.fixture(scope="module")
def node_client(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding the two packages and the client script."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        pytest.skip("node or npm is not installed")
    try:
        probe = _run([npm, "view", PACKAGES[0], "version"], 30)
    except subprocess.TimeoutExpired:
        pytest.skip("the npm registry cannot be reached (npm view timed out)")
    if probe.returncode != 0:
        pytest.skip(f"the npm registry cannot be reached: {probe.stderr.strip()[-300:]}")
    folder = tmp_path_factory.mktemp("node")
    install = _run(
        [npm, "install", "--prefix", str(folder), "--no-audit", "--no-fund", *PACKAGES], 180
    )
    assert install.returncode == 0, install.stderr
    (folder / "generate.js").write_text(doc_script())
    return folder


@pytest.fixture(scope="module")
def cluster(node_client: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    ckpt = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))
    c = start_cluster(ckpt, tmp_path_factory.mktemp("logs"))
    yield c
    c.stop()


def test_node_client_gets_the_python_clients_tokens(node_client: Path, cluster: Cluster) -> None:
    script = node_client / "generate.js"
    args = [str(ROOT / "protos"), cluster.address, cluster.client_key, PROMPT]
    done = _run(["node", str(script), *args, str(GREEDY.max_tokens)], 90)
    assert done.returncode == 0, done.stderr
    from_node = json.loads(done.stdout)

    async def python_client() -> list[int]:
        async with Client(cluster.address, api_key=cluster.client_key) as client:
            messages = [{"role": "user", "content": [{"type": "text", "text": PROMPT}]}]
            result = await client.generate_text(messages, GREEDY, timeout_s=60)
        return result.token_ids

    assert from_node == asyncio.run(python_client())
    assert len(from_node) == GREEDY.max_tokens


def test_node_client_without_a_key_is_unauthenticated(node_client: Path, cluster: Cluster) -> None:
    script = node_client / "generate.js"
    done = _run(
        ["node", str(script), str(ROOT / "protos"), cluster.address, "wrong", PROMPT, "2"], 60
    )
    assert done.returncode == 1
    assert done.stderr.startswith("16 ")  # grpc.status.UNAUTHENTICATED
