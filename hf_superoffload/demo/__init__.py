"""The demo: what ``hf-superoffload train``, the notebooks, the examples and the benchmarks run on.

- ``presets``: named random-init Llama-style shapes (``tiny`` .. ``14b``, the benchmarks' anchor configs) and
  ``build_on``, which creates one directly on a device;
- ``local_data``: a synthetic instruction corpus generated on the spot, a tokenizer trained on it, packing into
  token blocks (nothing downloaded);
- ``train_job``: the pieces of ``hf-superoffload train`` that choose the model and data (the Hub, or the two
  above offline), measure eval loss and samples, and write the run's outputs.

None of this is in the public API (``hf_superoffload.__all__``): it is an importable convenience whose names may
change with the demos. The core (``planning``, ``runtime``, the optimizer, the config and the integrations) never
imports this package when it is imported (``tests/unit/test_import_layers.py``); the command line and the
planner's preset names read it on demand.

``hf_superoffload.testing`` (``tiny_llama``, ``ReferenceAdamW``) stays outside: like ``torch.testing`` it is the
oracle users and tests check the optimizer against, part of the contract rather than a demo.
"""
