"""tools.compare's gpu column: the share of the method's training time its GPU was busy, from the training stage's
metrics (``<stage>.system.gpu_busy``); '-' for a run without a GPU and for best-of-N, which trains nothing. Its
compiled column: the distance of the compiled step's first use from the eager step (``<stage>.compile.*``). (The
whole table over real experiments: tests/test_experiments.py.)"""

from __future__ import annotations

from tools.compare import Row, table


def test_the_gpu_column_shows_the_training_stage_s_busy_share_and_sorts_by_it() -> None:
    ppo = {"method": "ppo", "ppo.init_kl_coef": 0.2}
    base = Row("main", True, ppo, {"ppo.seconds": 100.0, "ppo.system.gpu_busy": 0.456})
    exps = [Row("dpo-run", False, {"method": "dpo", "dpo.loss": "dpo", "dpo.beta": 0.1},
                {"dpo.seconds": 50.0, "dpo.system.gpu_busy": 0.91}),
            Row("cpu-run", False, ppo, {"ppo.seconds": 80.0, "ppo.system.cpu_cores": 1.0}),
            Row("bon", False, {"method": "best_of_n", "evaluate.best_of_n": 4}, {"ppo.system.gpu_busy": 0.5})]
    lines = table([(base, exps)], sort_by="gpu").splitlines()
    at = lines[0].index(" gpu ") + 1
    cells = {line.split()[0]: line[at:at + 4].strip() for line in lines[1:lines.index("")]}
    assert cells == {"main": "46%", "dpo-run": "91%", "cpu-run": "-", "bon": "-"}
    assert [line.split()[0] for line in lines[2:5]] == ["dpo-run", "cpu-run", "bon"]  # no share sorts last
    assert "gpu: the share of that time the GPU was busy" in " ".join(lines)


def test_the_compiled_column_shows_the_first_use_distance_or_eager() -> None:
    ppo = {"method": "ppo"}
    base = Row("main", True, ppo, {"ppo.compile.compiled": True, "ppo.compile.distance": 3.2e-5})
    exps = [Row("fell-back", False, ppo, {"ppo.compile.compiled": False, "ppo.compile.distance": 0.7}),
            Row("dpo-run", False, {"method": "dpo"}, {"dpo.seconds": 5.0})]
    lines = table([(base, exps)]).splitlines()
    at = lines[0].index(" compiled ") + 1
    cells = {line.split()[0]: line[at:at + 8].strip() for line in lines[1:lines.index("")]}
    assert cells == {"main": "3e-05", "fell-back": "eager", "dpo-run": "-"}
