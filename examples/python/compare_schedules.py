"""Compare pipetrain's schedules on the same sizes and costs: a table and a picture per schedule.

    PYTHONPATH=build/python python3 examples/python/compare_schedules.py [--stages 4] [--microbatches 8] [--out DIR]

Prints makespan, both bubble measures and peak activation memory (micro-batches) of every synchronous
schedule, and writes DIR/<name>.svg (a Gantt chart of each) and DIR/index.html (all of them on one page).
"""

import argparse
import os

import pipetrain


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", "-p", type=int, default=4)
    ap.add_argument("--microbatches", "-m", type=int, default=8)
    ap.add_argument("--cost", default="1:1:1", help="F:B:W per stage, as pipetrain simulate --cost")
    ap.add_argument("--comm", type=float, default=0.0)
    ap.add_argument("--out", default="schedules", help="folder for the SVG pictures")
    a = ap.parse_args()

    try:
        rows = pipetrain.compare(stages=a.stages, microbatches=a.microbatches, cost=a.cost, comm=a.comm)
    except ValueError as e:  # a bad --cost, --comm, --stages or --microbatches (a schedule left out only warns)
        ap.exit(2, f"error: {e}\n")
    rows.sort(key=lambda r: (r["makespan"], r["peak_memory"]))
    print(f"p={a.stages} m={a.microbatches} cost {a.cost} comm {a.comm}: fastest first")
    print(pipetrain.format_table(rows, ["name", "makespan", "bubble_fraction", "max_bubble", "peak_memory"]))

    os.makedirs(a.out, exist_ok=True)
    page = ["<html><body>"]
    for r in rows:
        v = r["virtual"]
        sim = pipetrain.simulate(r["name"], stages=a.stages, microbatches=a.microbatches, virtual=v, cost=a.cost,
                                 comm=a.comm)
        path = os.path.join(a.out, r["name"] + ".svg")
        sim.write_svg(path)
        page.append(f"<h3>{r['name']}</h3><img src='{r['name']}.svg'>")
    page.append("</body></html>")
    with open(os.path.join(a.out, "index.html"), "w") as f:
        f.write("\n".join(page))
    print(f"pictures: {a.out}/<name>.svg, all on {a.out}/index.html")


if __name__ == "__main__":
    main()
