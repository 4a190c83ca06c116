from fp4kit.cli import main

main()
