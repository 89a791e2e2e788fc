"""`epd make-examples DIR`: the README tour's image, frame folder and video file."""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster.cli import build_messages, main


def test_make_examples_writes_the_tours_media(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import av
    from PIL import Image

    assert main(["make-examples", str(tmp_path / "tour")]) == 0
    root = tmp_path / "tour"
    assert capsys.readouterr().out.splitlines() == [
        f"wrote {root / 'cat.png'}",
        f"wrote {root / 'clip'}/",
        f"wrote {root / 'clip.mp4'}",
    ]
    assert Image.open(root / "cat.png").size == (256, 256)
    frames = sorted((root / "clip").iterdir())
    assert [f.name for f in frames] == [f"frame_{k:02d}.png" for k in range(8)]
    with av.open(str(root / "clip.mp4")) as container:
        assert sum(1 for _ in container.decode(video=0)) == 8
    # What the tour then sends: an image, a frame folder and a video file.
    messages = build_messages("hi", [root / "cat.png"], [root / "clip", root / "clip.mp4"])
    kinds = [part["type"] for part in messages[0]["content"]]
    assert kinds == ["image", "video", "video", "text"]
    # Deterministic: a second run writes the same image bytes (the prefix cache hits).
    before = (root / "cat.png").read_bytes()
    assert main(["make-examples", str(root)]) == 0
    assert (root / "cat.png").read_bytes() == before


def test_make_serve_passes_args_to_epd_serve() -> None:
    import shutil
    import subprocess

    if shutil.which("make") is None:
        pytest.skip("no make on this machine")
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run(
        ["make", "-n", "-o", ".venv/.installed", "serve", "ARGS=--pools-prefill-replicas 2"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    assert ".venv/bin/python -m epd serve --pools-prefill-replicas 2" in done.stdout


def test_every_epd_command_of_the_readme_parses() -> None:
    import shlex

    from cluster.cli import build_parser

    root = Path(__file__).resolve().parents[1]
    lines = [
        line.removeprefix("$ epd ").split("  #")[0]
        for line in (root / "README.md").read_text().splitlines()
        if line.startswith("$ epd ")
    ]
    assert len(lines) >= 8
    parser = build_parser()
    for line in lines:
        parser.parse_args(shlex.split(line))  # SystemExit on a wrong flag or command
