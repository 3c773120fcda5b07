"""Time and memory per strategy from a model profile and a hardware profile.

    from partrain.predict import Plan, enumerate_plans, predict_plan
    for plan in enumerate_plans(model_profile, workers=4, batch_size=64):
        p = predict_plan(model_profile, hardware, plan)
        print(plan.label(), p.seconds_per_step, p.memory_bytes_per_worker, p.fits(limit))
"""

from partrain.predict.strategies import Plan, Prediction, check_plan, enumerate_plans, predict_plan

__all__ = ["Plan", "Prediction", "check_plan", "enumerate_plans", "predict_plan"]
