from chapters.ch02_fastapi_async.server import main

main()
