"""The Python module against the `pipetrain` command: time of `import pipetrain` (fresh interpreters), and
of one small simulation through each (docs/BENCHMARKS.md, issue 27).

    PYTHONPATH=build/python python3 bench/python_vs_cli.py [--bin build/pipetrain] [--repeat 15] [--quick]

Figures are medians over --repeat runs (wall time): import in a fresh `python3 -X importtime` (its
"pipetrain" line, cumulative); `python3 -c 'pass'` as the interpreter's own start; the simulation
in-process (pipetrain.simulate(...).to_dict(), the interpreter already running) and as a whole process
(python3 -c 'import pipetrain; ...'), against `pipetrain simulate ... --json` as a process. --quick: 3
runs, for the test suite (it checks only that every figure is measured).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

CASE = ["-s", "1f1b", "-p", "4", "-m", "8"]
PY_CASE = "pipetrain.simulate('1f1b', stages=4, microbatches=8).to_dict()"


def wall(cmd, env=None):
    t = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    return (time.perf_counter() - t) * 1e3


def import_ms(env):
    r = subprocess.run([sys.executable, "-X", "importtime", "-c", "import pipetrain"], check=True, env=env,
                       capture_output=True, text=True)
    for line in r.stderr.splitlines():
        parts = [p.strip() for p in line.split("|")]
        if len(parts) == 3 and parts[2] == "pipetrain":
            return int(parts[1]) / 1e3
    raise RuntimeError("no 'pipetrain' line in -X importtime's output:\n" + r.stderr[-2000:])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bin", default=os.environ.get("PIPETRAIN_BIN", "build/pipetrain"))
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    n = 3 if a.quick else a.repeat
    env = dict(os.environ)
    import pipetrain

    rows = {}
    rows["python3 -c pass (interpreter start), ms"] = statistics.median(wall([sys.executable, "-c", "pass"]) for _ in range(n))
    rows["import pipetrain (-X importtime, cumulative), ms"] = statistics.median(import_ms(env) for _ in range(n))
    inproc = []
    for _ in range(max(n, 20)):
        t = time.perf_counter()
        exec(PY_CASE, {"pipetrain": pipetrain})
        inproc.append((time.perf_counter() - t) * 1e3)
    rows["simulate 1f1b p=4 m=8 in-process (Python), ms"] = statistics.median(inproc)
    rows["same, python3 process (start + import + simulate), ms"] = statistics.median(
        wall([sys.executable, "-c", "import pipetrain; " + PY_CASE], env) for _ in range(n))
    if os.access(a.bin, os.X_OK):
        rows["same, pipetrain simulate --json process, ms"] = statistics.median(
            wall([a.bin, "simulate", *CASE, "--json"]) for _ in range(n))
    load = os.getloadavg()[0]
    print(f"{n} runs each, medians; {os.cpu_count()} cores, load average {load:.1f}; python {sys.version.split()[0]}")
    for k, v in rows.items():
        print(f"  {k:<58} {v:9.2f}")
    if a.quick and not all(v > 0 for v in rows.values()):
        sys.exit("a figure is not positive: " + json.dumps(rows))


if __name__ == "__main__":
    main()
