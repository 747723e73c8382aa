from chapters.ch01_flask_sync.server import main

main()
