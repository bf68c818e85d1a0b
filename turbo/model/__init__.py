"""The trunk as data: its weights and a sequence's state (trunk), and the step protocol a backend
implements for it (step). Backends (turbo/backends/) run the math; this package only names it."""
