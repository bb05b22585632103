from servematrix.emulator.cli import main

main()
