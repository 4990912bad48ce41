"""Evaluating eqmoe models with lm-evaluation-harness.

:mod:`eqmoe.evaluation.scoring` is plain JAX (log-likelihoods of right-padded batches, bucketed so a few compiled
programs serve every request); :mod:`eqmoe.evaluation.lm_eval_model` is the harness's model (``--model eqmoe``) and
:mod:`eqmoe.evaluation.harness` runs its evaluator. Only those two import ``lm_eval``, and only when imported:
``pip install 'eqmoe[eval]'``.
"""
