"""An install turned into a trunk and a drafter in memory: the install's checks against the
runtime (install_check), the plan of what each tensor becomes (load_plan), the tensors read as
the plan says (reader, open_layout), and the loader that builds both parts."""
