"""The cost model: time and memory per strategy from a model profile and a hardware profile.

    from partrain.predict import Plan, enumerate_plans, predict_plan
    for plan in enumerate_plans(model_profile, workers=4, batch_size=64):
        p = predict_plan(model_profile, hardware, plan)
        print(plan.label(), p.seconds_per_step, p.memory_bytes_per_worker, p.fits(limit))

Pure Python, no torch: profiles (``profiles``: dataclasses + JSON), collective fits
(``fits``), stage cuts (``cut``), the machine fingerprint (``machine``), and the costs
(``compute``, ``comm``, ``memory``, ``pipeline_sim``, ``data_parallel``, ``pipeline``,
``predictor``). ``profile/`` measures with torch and writes the profiles read here.
"""

from partrain.predict.plan import Plan, check_plan, enumerate_plans
from partrain.predict.prediction import Prediction
from partrain.predict.predictor import predict_plan

__all__ = ["Plan", "Prediction", "check_plan", "enumerate_plans", "predict_plan"]
