from kvfleet_runtime.cli import main

main()
