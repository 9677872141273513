"""Fleet-wide weight updates: the target every GPU worker converges on and what each serves
(``store``), the update call that waits for the fleet (``updates``), a GPU worker's side of it
(``sync``) and where a target's directory may be (``paths``)."""
