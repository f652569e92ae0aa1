"""The top of the package: the pipeline config that combines every component's section, its
pydantic schema for the flows' parameters, the generated reference, and a run's set-up."""
