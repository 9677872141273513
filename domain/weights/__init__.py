"""Fleet-wide weight updates: the target every GPU worker converges on and what each serves
(``store``), the update call that waits for the fleet (``updates``) and where a target's directory
may be (``paths``). A GPU worker's side of it is ``workers.gpu.weight_sync``."""
