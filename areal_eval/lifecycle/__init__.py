"""One run's lifecycle on every path: following the manifest, the planner, the in-flow loop, the
record shared by flow runs, delivery to the tracker."""
