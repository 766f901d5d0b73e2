from kvfleet_lab.cli import main

main()
