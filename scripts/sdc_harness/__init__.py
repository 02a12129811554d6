"""The stand-in cluster that the tests and the end-to-end demo share: a real Kubernetes
API server on loopback and the operator as a real process (:mod:`.cluster`; the tests'
operators forked from one that imported their dependencies, :mod:`.operator_zygote`), what the
scheduler and the kubelet would do for the pods that must run (:mod:`.kubelet`), what the
Kubeflow training operator would do for a PyTorchJob (:mod:`.training`), SageMaker's
endpoint on loopback (:mod:`.fake_sagemaker`), test certificates (:mod:`.tls`) and other
projects' CRDs (``crds/``).

It lives under ``scripts/`` because the repository's top level is fixed (DESIGN.md) and
it is no part of the distribution: the wheel ships ``sdc_agent``, ``sdc_operator`` and
``sdc_common`` only. It is imported by path: ``scripts/`` is on ``sys.path`` for a script
run from it (``python scripts/e2e_demo.py``), for pytest (``pythonpath`` in
pyproject.toml) and for the benchmarks under bench/ (which add it).
"""
