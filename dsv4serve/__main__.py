from dsv4serve.cli import main

raise SystemExit(main())
