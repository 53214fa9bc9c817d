"""Moving models between Megalith and other ecosystems: Hugging Face (:mod:`.hf`,
:mod:`.hf_t5`) and Megatron-LM checkpoints (:mod:`.megatron`). Import the submodule
you need; importing this package alone loads nothing heavy (``megalith --help`` stays fast)."""
