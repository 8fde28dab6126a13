"""``autopar show --html`` / ``diff --html``: one self-contained page, rendered by headless Chromium (Debian's
``chromium``, which ``.ci/run`` installs): the screenshot is not blank and every section is in the DOM."""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import struct
import subprocess
import zlib
from pathlib import Path

import numpy as np
import pytest

from autopar.ir.plan import Plan, load_plan
from autopar.planner.cli import main
from autopar.planner.html_report import COLORS, diff_html, plan_html
from autopar.planner.report import diff_plans

from golden_files import GOLDEN_DIR

PLANS = GOLDEN_DIR / "plans"
SECTIONS = ("summary", "timeline", "memory", "sharding", "alternatives")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None and os.environ.get("AUTOPAR_REQUIRE_CHROMIUM") != "1",
    reason="no chromium on PATH (.ci/run installs Debian's chromium and sets AUTOPAR_REQUIRE_CHROMIUM=1)")


def _chromium(tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    assert CHROMIUM, "chromium is not installed (apt-get install -y chromium)"
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
             "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={tmp / 'profile'}"]
    return subprocess.run([CHROMIUM, *flags, *args], capture_output=True, text=True, timeout=120, check=True)


def _png_pixels(path: Path) -> np.ndarray:
    """The RGB(A) pixels of an 8-bit non-interlaced PNG (what Chromium writes), as an (h, w, channels) array."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat = 8, b""
    w = h = channels = 0
    while pos < len(data):
        (n,), kind = struct.unpack(">I", data[pos:pos + 4]), data[pos + 4:pos + 8]
        body = data[pos + 8:pos + 8 + n]
        if kind == b"IHDR":
            w, h, depth, color, _, _, interlace = struct.unpack(">IIBBBBB", body)
            assert depth == 8 and interlace == 0 and color in (2, 6), (depth, color, interlace)
            channels = 3 if color == 2 else 4
        elif kind == b"IDAT":
            idat += body
        pos += 12 + n
    raw = np.frombuffer(zlib.decompress(idat), dtype=np.uint8).reshape(h, 1 + w * channels)
    out = np.zeros((h, w * channels), dtype=np.int32)
    prev = np.zeros(w * channels, dtype=np.int32)
    for y in range(h):
        f, line = raw[y, 0], raw[y, 1:].astype(np.int32)
        if f == 0:
            cur = line
        elif f == 2:
            cur = (line + prev) % 256
        elif f == 1:  # Sub: a running sum per channel
            cur = (np.cumsum(line.reshape(w, channels), axis=0) % 256).reshape(-1)
        else:  # Average and Paeth depend on the pixel to the left: one pixel at a time
            cur = np.zeros_like(line)
            for i in range(0, w * channels, channels):
                a = cur[i - channels:i] if i else np.zeros(channels, dtype=np.int32)
                b, c = prev[i:i + channels], prev[i - channels:i] if i else np.zeros(channels, dtype=np.int32)
                if f == 3:
                    pred = (a + b) // 2
                else:
                    p = a + b - c
                    pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                    pred = np.where((pa <= pb) & (pa <= pc), a, np.where(pb <= pc, b, c))
                cur[i:i + channels] = (line[i:i + channels] + pred) % 256
        out[y], prev = cur, cur
    return out.reshape(h, w, channels)


def _plan_with_alternatives() -> tuple[Plan, list[Plan]]:
    best = load_plan(PLANS / "llama-tiny_dgx-h100_2n_gb32_pp2_tp2.yaml")
    other = dataclasses.replace(best, zero=1)
    return best, [best, other]


def test_page_is_self_contained() -> None:
    best, alts = _plan_with_alternatives()
    for html in (plan_html(best, alts), diff_html(best, alts[1], diff_plans(best, alts[1]))):
        assert "<script" not in html and "<link" not in html and "<img" not in html and "@import" not in html
        assert not re.search(r"(src|href)\s*=", html) and "url(" not in html
        assert set(re.findall(r"https?://[^'\" ]+", html)) <= {"http://www.w3.org/2000/svg"}
    page = plan_html(best, alts)
    for sec in SECTIONS:
        assert f"id='{sec}'" in page
    alternatives = page.split("id='alternatives'")[1]
    assert alternatives.count("<tr><td>") == 1 and "ZeRO 0 -&gt; 1" in alternatives  # the best is not repeated


@needs_chromium
def test_report_renders_in_headless_chromium(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan = PLANS / "llama-tiny_dgx-h100_2n_gb32_pp2_tp2.yaml"
    page, diff_page = tmp_path / "report.html", tmp_path / "diff.html"
    assert main(["show", str(plan), "--html", str(page)]) == 0
    assert main(["diff", str(PLANS / "gpt2-small_dgx-h100_4n_gb64.yaml"), str(plan), "--html", str(diff_page)]) == 0
    capsys.readouterr()

    dom = _chromium(tmp_path, "--dump-dom", page.as_uri()).stdout
    for sec in SECTIONS:
        assert re.search(rf"<section id=\"{sec}\"", dom), sec
    assert dom.count("<rect") > 10 and "rank 1" in dom
    diff_dom = _chromium(tmp_path, "--dump-dom", diff_page.as_uri()).stdout
    assert "id=\"differences\"" in diff_dom and "id=\"a-timeline\"" in diff_dom and "id=\"b-memory\"" in diff_dom
    assert "not comparable" in diff_dom

    shot = tmp_path / "shot.png"
    _chromium(tmp_path, f"--screenshot={shot}", "--window-size=640,480", "--hide-scrollbars", page.as_uri())
    px = _png_pixels(shot)[..., :3]
    colors = {tuple(c) for c in px.reshape(-1, 3)[::7]}
    assert len(colors) > 20, "the screenshot is (nearly) blank"
    assert (px.sum(axis=2) < 3 * 250).mean() > 0.02, "almost every pixel is white"
    fwd = np.array([int(COLORS["forward"][i:i + 2], 16) for i in (1, 3, 5)])
    assert (np.abs(px - fwd).sum(axis=2) < 30).sum() > 50, "no forward bar of the timeline is drawn"
