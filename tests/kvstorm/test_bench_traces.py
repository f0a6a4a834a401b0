"""`kvstorm bench traces` end to end on the bundled model: a small Mooncake trace replayed against a fresh kvstorm
(no vLLM here), its scaling said, every request sent on schedule, and the server's own hit rate beside the share of
prompt tokens the trace repeats."""

from __future__ import annotations

import json
import subprocess
import sys


def test_a_mooncake_trace_is_replayed_and_the_server_serves_the_blocks_it_repeats(tmp_path):
    # Eight requests 250 ms apart; at length_scale 1/32 each hash id is a 16-token block (one of kvstorm's blocks) and
    # each prompt 4 blocks: every request after the first repeats the first three of them.
    trace = tmp_path / "mooncake.jsonl"
    rows = [
        {"timestamp": 250 * index, "input_length": 2048, "output_length": 128, "hash_ids": [0, 1, 2, 100 + index]}
        for index in range(8)
    ]
    trace.write_text("".join(json.dumps(row) + "\n" for row in rows))
    spec = f"trace:path={trace},length_scale=0.03125,max_len=128"
    command = [sys.executable, "-m", "kvstorm", "bench", "--no-docs", "traces", "--trace", spec, "--vllm-command", ""]
    run = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "8 of its 8 requests" in run.stdout
    assert "lengths scaled by 0.03125 (prefix blocks of 16 tokens)" in run.stdout
    (row,) = [line for line in run.stdout.splitlines() if line.startswith("| mooncake.jsonl | kvstorm |")]
    cells = [cell.strip() for cell in row.strip().strip("|").split("|")]
    assert cells[2] == "8 / 8"
    sent, scheduled = (float(rate) for rate in cells[7].split("/"))
    assert scheduled == 4.0  # 7 gaps of 250 ms
    assert abs(sent - scheduled) <= 0.05  # each sent within a few ms of its time
    assert cells[8] == f"{7 * 48 / (8 * 64):.1%}"  # 48 of each later prompt's 64 tokens
    # The server hits whole blocks that an earlier request has computed, and never a prompt's last token.
    hit_rate = float(cells[9].removesuffix("%")) / 100
    assert 0.4 < hit_rate <= 7 * 48 / (8 * 64)
    assert "vLLM: `(not run)`" in run.stdout
