"""LoRA adapters served beside the base model (``--enable-lora``): read from peft directories
(``adapter``), applied from outside the model by wrapping its projections (``layers``), and
kept in a fixed number of device slots (``manager``)."""
