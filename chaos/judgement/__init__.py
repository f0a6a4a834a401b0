"""What a run means: the verdict (HELD only with positive evidence), its tables, the SLO spec judged over one load,
whether an experiment applies to a server at all, and the side-by-side comparison of targets."""
