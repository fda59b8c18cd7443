"""The command line, an app on the engine: `zeropp train | plan | bench | export |
launch` (main.py parses them all; commands.py runs the ones beside train) and the
launcher that starts W local workers (launch.py), which the tests use too.
Nothing in the core imports this package."""
