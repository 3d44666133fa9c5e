"""The command line: sub-commands run, and errors come out as one clear line."""

from __future__ import annotations

import subprocess
import sys

from caddtree.cli import main


def test_tree_demo_runs(capsys):
    assert main(["tree-demo", "--rounds", "3", "--vocab", "500"]) == 0
    out = capsys.readouterr().out
    assert "CaDDTree n*" in out and "R2" in out
    rows = [line for line in out.splitlines() if line.strip()[:1].isdigit() and "|" in line]
    assert len(rows) == 3


def test_console_entry_point_reports_usage_errors():
    proc = subprocess.run(
        [sys.executable, "-m", "caddtree.cli", "no-such-command"], capture_output=True, text=True
    )
    assert proc.returncode == 2
    assert "invalid choice" in proc.stderr and "Traceback" not in proc.stderr
