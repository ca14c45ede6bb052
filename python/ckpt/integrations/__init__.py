"""ckpt inside the training frameworks people already use.

One module per framework, each imported only when asked for (``import ckpt`` and
``import ckpt.torch`` import none of them), each installed with its own extra:

- ``ckpt.integrations.lightning`` (``pip install 'ckpt[lightning]'``): strategies for
  PyTorch Lightning's ``Trainer`` that save through ckpt on every rank and resume
  resharded, data position and RNG included;
- ``ckpt.integrations.transformers`` (``[transformers]``): ``CkptTrainer``, the
  Hugging Face ``Trainer`` saving to and resuming from ckpt;
- ``ckpt.integrations.accelerate`` (``[transformers]``): ``CkptAccelerator``, whose
  ``save_state``/``load_state`` go through ckpt;
- ``ckpt.integrations.torchtitan`` (``[torchtitan]``): ``CkptCheckpointManager``,
  the checkpoint manager torchtitan builds from its config.

Every integration is a thin adapter over ``ckpt.torch``: the framework's tensors go
through ckpt's save (overlapped staging, block CRCs, atomic commit) and load
(verified, resharded onto the current world); what the framework keeps besides
tensors rides along as ckpt's non-tensor state. Nothing of the format, the commit or
the load planner is written again here. docs/INTEGRATIONS.md says, per framework,
which lines a user changes and what a resume onto another world size does.
"""
