"""What-if replay: the captured step as a dependency graph, replayed with and without each wall and fix."""
