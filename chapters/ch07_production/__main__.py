from chapters.ch07_production.server import main

main()
