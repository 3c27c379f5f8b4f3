"""Recovery drills: N cycles under load with injected faults, checked and reported.

``faults`` (what can be injected and the outcome each must have), ``runner`` (the processes
and the cycles), ``report`` (report.json and the verdict), ``timeline`` (timeline.png).
The CLI is ``ckptctl drill`` (``cli.drill_cmd``). Neighbours: ``controller`` (what it drives),
``engine.load`` (the load), ``agent.failpoints`` (faults armed through the environment).
"""
