"""One model over several processes (issue 56): the plan checked at open (plan.py), the ranks'
gloo group (group.py), a pipeline stage (stage.py) and rank 0's trunk over the stages
(pipeline.py). The engine opens a `PipelineTrunk` where OpenOptions.parallel asks for more
than one process; everything above the trunk (driver, drafters, scheduler) is unchanged."""

from .pipeline import PipelineTrunk, open_pipeline
from .plan import Stage, check_plan, stages

__all__ = ["PipelineTrunk", "Stage", "check_plan", "open_pipeline", "stages"]
